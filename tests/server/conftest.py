"""Fixtures of the server tests: ``follower_factory`` starts :class:`~tests.helpers.follow.Follower`
ranks (the real poller, the rank's chain check, live tensors) and closes them after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers.follow import Follower, Weights


@pytest.fixture
def follower_factory() -> Iterator[Callable[..., Follower]]:
    made: list[Follower] = []

    def make(url: str, live: Weights, **options: Any) -> Follower:
        f = Follower(url, live, **options)
        f.poller.start()
        made.append(f)
        return f

    yield make
    for f in made:
        f.poller.close()

"""Fixtures of the rank's tests: ``tp_world``, vLLM's parallel state for one process (TP ranks
simulated while a model is built: tests/helpers/tp_world.py), and ``follower_factory``, which
starts :class:`~tests.helpers.follow.Follower` ranks (the real poller, the rank's chain check,
live tensors) and closes them after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers.follow import Follower, Weights
from tests.helpers.tp_world import TPWorld, single_process_world


@pytest.fixture(scope="module")
def tp_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPWorld]:
    pytest.importorskip("vllm")
    world = TPWorld(tmp_path_factory.mktemp("shardmap"))
    with single_process_world(world, world.model("llama_gqa").vllm_config):
        yield world


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

"""Fixtures of the fault matrix: a misbehaving HTTP server on loopback (``Hostile``,
tests/helpers/faults.py), every log record, and a small published bucket."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.faults import Hostile
from tests.helpers.publishing import Trainer, publish_run


@pytest.fixture
def hostile() -> Iterator[Hostile]:
    with Hostile() as server:
        yield server


@pytest.fixture
def all_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)
    yield caplog


@pytest.fixture
def small_bucket(tmp_path: Path) -> tuple[str, dict[int, Any]]:
    """file:// bucket: anchor 0, deltas 1..3 (v2, several chunks per tensor)."""
    url = f"file://{tmp_path}/bucket"
    truth = publish_run(url, range(4), Trainer(seed=11, lr=3e-6), anchor_every=10,
                        max_file_bytes=2048, codec="sparse-v2")
    return url, truth

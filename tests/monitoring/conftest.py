"""Fixtures of the monitoring tests: a real Prometheus on loopback (tests/helpers/monitoring.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.monitoring import Prometheus, need_binary


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Any]:
    """Start a real Prometheus with a config (skips when the binary is missing)."""
    binary = need_binary("prometheus")
    started: list[Prometheus] = []

    def start(config: str) -> Prometheus:
        prom = Prometheus(binary, tmp_path / f"prom{len(started)}", config)
        started.append(prom)
        return prom

    (tmp_path / "prom0").mkdir()
    (tmp_path / "prom1").mkdir()
    yield start
    for prom in started:
        prom.stop()

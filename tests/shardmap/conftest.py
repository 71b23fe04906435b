"""Fixtures of the shard-map tests: ``tp_world``, vLLM's parallel state for one process (TP
ranks simulated while a model is built: tests/helpers/tp_world.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.tp_world import TPWorld, single_process_world


@pytest.fixture(scope="module")
def tp_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPWorld]:
    pytest.importorskip("vllm")
    world = TPWorld(tmp_path_factory.mktemp("shardmap"))
    with single_process_world(world, world.model("llama_gqa").vllm_config):
        yield world

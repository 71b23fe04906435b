"""The 7B-shaped shard maps the GPU test replays are what vLLM's loaders produce today.

``tests/data/shardmaps/<model>_tp2_rank<r>.json`` hold :meth:`ShardMap.to_json` of a one-layer
Llama-2-7B / Qwen2-7B at TP=2, derived here from the real vLLM classes. Regenerate them with
``DELTASYNC_RECORD_SHARDMAPS=1 pytest tests/server/worker/test_recorded_maps.py``.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.tp_world import RECORDED, TPWorld
from vllm_deltasync.server.vllm.loaders import LOADER
from vllm_deltasync.server.worker.shardmap import ShardMap


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", ["llama2_7b", "qwen2_7b"])
def test_recorded_7b_maps_match_vllm(tp_world: TPWorld, kind: str, rank: int) -> None:
    params = tp_world.model(kind).checkpoint_params()
    shardmap = ShardMap.from_model(tp_world.build(kind, 2, rank), params, loader=LOADER)
    path = RECORDED / f"{kind}_tp2_rank{rank}.json"
    if os.environ.get("DELTASYNC_RECORD_SHARDMAPS") == "1":
        RECORDED.mkdir(exist_ok=True)
        path.write_text(json.dumps(json.loads(shardmap.to_json()), indent=1, sort_keys=True))
    assert json.loads(path.read_text()) == json.loads(shardmap.to_json())

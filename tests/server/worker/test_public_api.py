"""The shard-map and apply modules' public names (import without vLLM: tests/test_architecture.py)."""

from __future__ import annotations

import vllm_deltasync.server.worker.apply as apply_mod
import vllm_deltasync.server.worker.shardmap as shardmap_mod


def test_exported_members() -> None:
    assert sorted(shardmap_mod.__all__) == [
        "Block", "DenseView", "Piece", "ShardMap", "Target", "translate_all",
    ]
    assert sorted(apply_mod.__all__) == [
        "Undo", "apply_patches", "checkpoint_digest", "compact", "live_values", "merge_pieces",
        "prepare", "sha256_hex", "staged_nbytes", "tensor_digest",
    ]
    for mod in (shardmap_mod, apply_mod):
        for name in mod.__all__:
            assert getattr(mod, name).__doc__, f"{mod.__name__}.{name} has no docstring"

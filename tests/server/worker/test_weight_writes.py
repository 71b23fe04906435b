"""Writes behind our back through vLLM's own loaders are seen (server/extension.py).

vLLM's loaders write through ``param.data``, which moves no version counter, so a rank sees a
write made outside deltasync only because the calls are watched: the runner's
``reload_weights`` and the model's ``load_weights`` (what vLLM's sparse
``load_checkpoint_weight_patches`` goes through). The write is settled (counted, the map rebuilt)
at the next status call, outside the writer's call: vLLM's sparse patch loader still has
``torch.Tensor.copy_`` replaced inside it, where a rebuilt map would learn the wrong loader. A
real ``TargetRank`` on vLLM's own Llama module; the worker and runner objects are stand-ins for
vLLM's (their attributes only).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tests.helpers.tp_world import TPWorld, live_checkpoint, target_rank
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.server.worker.target import TargetRank


def _rank(tp_world: TPWorld, tmp_path: Path) -> tuple[TargetRank, Any, dict[str, torch.Tensor]]:
    ckpt, live, weights = live_checkpoint(tp_world, tmp_path, "llama_gqa", seed=21)

    def reload_weights(weights_iterator: Any) -> None:  # as vLLM's runner: load_weights inside
        live.load_weights(weights_iterator)

    worker = SimpleNamespace(
        rank=0, model_runner=SimpleNamespace(model=live, reload_weights=reload_weights),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(model=str(ckpt))))
    state = target_rank(live, ckpt, SyncConfig(url=f"file://{tmp_path}/bucket"))
    return state, worker, weights


def test_load_weights_and_reload_behind_our_back_each_count_once(
        tp_world: TPWorld, tmp_path: Path) -> None:
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    from vllm_deltasync.server.vllm.worker import watch_weight_writes as _watch_weight_writes

    state, worker, weights = _rank(tp_world, tmp_path)
    try:
        _watch_weight_writes(worker, state)
        _watch_weight_writes(worker, state)  # idempotent: still one count per call
        model = worker.model_runner.model
        assert state.reloads == 0
        # vLLM's sparse patch loader, one element of the final norm
        name = "model.norm.weight"
        patch = CheckpointWeightPatch(name, tuple(weights[name].shape), torch.bfloat16,
                                      torch.tensor([8.0], dtype=torch.bfloat16),
                                      torch.tensor([0]))
        load_checkpoint_weight_patches(model, [patch])
        assert float(dict(model.named_parameters())[name].detach().reshape(-1)[0]) == 8.0
        # noted, settled at the engine core's next status call (outside the writer's call)
        assert state.written_behind and state.reloads == 0
        state.settle_writes()
        assert state.reloads == 1 and state.refused is None  # the rebuilt map places everything
        assert state.status().reloads == 1
        # a reload runs load_weights inside: one count, not two
        worker.model_runner.reload_weights(iter(weights.items()))
        state.settle_writes()
        assert state.reloads == 2
        # a plain load_weights by hand
        model.load_weights(iter([(name, weights[name])]))
        state.settle_writes()
        assert state.reloads == 3
        # our own map rebuild (the probe runs load_weights) is not a write behind our back
        state.shardmap = state._build_map()
        state.settle_writes()
        assert state.reloads == 3 and not state.written_behind
    finally:
        state.poller.close()

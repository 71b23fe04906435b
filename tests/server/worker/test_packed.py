"""The packed CPU mode on vLLM's own modules (server/worker/packed.py, server/extension.py).

vLLM's CPU GEMM dispatch packs each linear weight into a kernel layout the kernel then computes
from. With ``cpu_kernels="packed"`` the extension keeps the parameter and puts a repack callable
on the layer. A real ``TargetRank`` on vLLM's Qwen2 module (q/k/v biases), every linear layer and
the lm_head packed by vLLM's own dispatch (oneDNN on this machine), the kernels called the way
vLLM's ``cpu_unquantized_gemm`` calls them. Shows:

* a write through the shard map does not reach the packed copy by itself (what the mode
  exists for), and after ``refresh`` of the written parameters the layer computes what a kernel
  freshly packed from the written weights computes, bit for bit; putting the elements back and
  refreshing gives the old outputs back bit for bit;
* the startup proof's write check sees every linear weight class change the outputs with the
  rank's refresh; without it neither the map's writes nor the control round's direct writes
  reach a packed copy, and no linear weight class is marked as changing the outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.hosts import NO_PACKING, vllm_cpu_dispatch, vllm_packs_bf16_linears
from tests.helpers.tp_world import TPWorld, live_checkpoint, target_rank
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.server.worker.packed import PackedLayers
from vllm_deltasync.server.worker.target import TargetRank


def _packed_rank(tp_world: TPWorld, tmp_path: Path) -> TargetRank:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from vllm_deltasync.server.vllm.cpu_gemm import install_packed as _install_packed

    original = vllm_cpu_dispatch()
    ckpt, live, _ = live_checkpoint(tp_world, tmp_path, "qwen2_bias", seed=5)
    for module in live.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            _install_packed(original, module)
    state = target_rank(live, ckpt, SyncConfig(url=f"file://{tmp_path}/bucket"))
    if not state.packed:
        state.close()
        pytest.skip(NO_PACKING)
    return state


def _input(module: torch.nn.Module) -> torch.Tensor:
    """A fixed input for ``module``'s kernel."""
    k = module.weight.shape[1]
    return torch.linspace(-1, 1, 4 * k, dtype=torch.float32).reshape(4, k).to(torch.bfloat16)


def _outputs(packed: PackedLayers) -> list[torch.Tensor]:
    """Each packed layer's kernel on a fixed input, as vLLM's ``cpu_unquantized_gemm`` calls it."""
    return [m.cpu_linear(_input(m), m.weight, getattr(m, "bias", None)) for m in packed.layers]


def _forward(packed: PackedLayers) -> Any:
    return lambda: torch.cat([o.reshape(-1).float() for o in _outputs(packed)])


def _writers(state: TargetRank, param: torch.Tensor) -> tuple[str, list[str]]:
    """``param``'s runtime name and the checkpoint names written into it."""
    names = [n for n in state.shardmap.names
             if any(t.param is param for t in state.shardmap.targets(n))]
    name = next(t.param_name for t in state.shardmap.targets(names[0]) if t.param is param)
    return name, names


def test_refresh_packs_the_written_layers_again(tp_world: TPWorld, tmp_path: Path) -> None:
    from vllm_deltasync.server.worker.apply import Undo, apply_patches
    from vllm_deltasync.server.worker.proof import _sample_pieces

    state = _packed_rank(tp_world, tmp_path)
    try:
        packed = state.packed
        assert len(packed.layers) >= 5  # qkv, o, gate_up, down per layer, and the lm_head
        qkv = next(m for m in packed.layers if m.bias is not None)
        name, names = _writers(state, qkv.weight)
        before = _outputs(packed)
        with torch.no_grad():
            pieces = _sample_pieces(state.shardmap, names, name)
            undo = Undo()
            apply_patches(pieces, undo)
            i = packed.layers.index(qkv)
            assert torch.equal(_outputs(packed)[i], before[i]), "the packed copy saw the write"
            assert packed.refresh(p.param for p in pieces) == 1
            after = _outputs(packed)
            assert not torch.equal(after[i], before[i])
            fresh = qkv._deltasync_repack()  # packed from the written weights, from nothing
            assert torch.equal(fresh(_input(qkv), qkv.weight, qkv.bias), after[i])
            assert all(torch.equal(a, b) for j, (a, b) in enumerate(zip(after, before, strict=True))
                       if j != i), "a layer nobody wrote changed"
            undo.revert()
            packed.refresh(p.param for p in pieces)
            assert all(torch.equal(a, b) for a, b in zip(_outputs(packed), before, strict=True))
        assert packed.status()["repacked"] == 2
    finally:
        state.poller.close()


def test_the_write_check_needs_the_refresh(tp_world: TPWorld, tmp_path: Path) -> None:
    from vllm_deltasync.server.worker.proof import check_writes, class_names

    state = _packed_rank(tp_world, tmp_path)
    try:
        forward = _forward(state.packed)
        classes = class_names(state.shardmap)
        linear = [c for c in classes if c.endswith("proj.weight") or c.startswith("lm_head")]
        assert len(linear) >= 5, classes
        with torch.no_grad():
            state.prove_values()
            state.prove_writes(classes, forward, world=1)  # with the rank's refresh
            assert state.report is not None and not state.report.failures
            checks = {c: state.report.classes[c]["write_check"] for c in linear}
            assert set(checks.values()) == {"changed outputs"}, checks

            state.prove_values()  # a new report
            check_writes(state.shardmap, forward, state.report, rank=0, world=1,
                         classes=classes)  # no refresh: the packed copies never change
            checks = {c: state.report.classes[c]["write_check"] for c in linear}
        # no write of the map, nor the control round's direct write, reaches a packed copy:
        # the proof holds no evidence for these classes (biases are passed to the kernel at
        # each call on this machine's oneDNN path, so they are not among them)
        assert "changed outputs" not in checks.values(), checks
    finally:
        state.poller.close()


def test_kernels_packed_ahead_equal_kernels_packed_at_the_switch(
        tp_world: TPWorld, tmp_path: Path) -> None:
    from vllm_deltasync.server.worker.apply import apply_patches
    from vllm_deltasync.server.worker.proof import _sample_pieces

    state = _packed_rank(tp_world, tmp_path)
    try:
        packed = state.packed
        down = next(m for m in packed.layers if m.weight.shape[1] > m.weight.shape[0])
        name, names = _writers(state, down.weight)
        with torch.no_grad():
            before = _outputs(packed)
            pieces = _sample_pieces(state.shardmap, names, name)
            assert packed.prebuild(1, 0, pieces, limit_bytes=16) is None  # over the limit
            built = packed.prebuild(1, 0, pieces, limit_bytes=1 << 30)
            assert built is not None and [m for m, _ in built.kernels] == [down]
            assert torch.equal(_outputs(packed)[packed.layers.index(down)],
                               before[packed.layers.index(down)])  # nothing live changed
            apply_patches(pieces)  # the switch writes the parameters, then swaps
            assert packed.swap(built, [p.param for p in pieces]) == 1
            ahead = _outputs(packed)
            packed.refresh([down.weight])  # what packing at the switch gives
            assert all(torch.equal(a, b) for a, b in zip(ahead, _outputs(packed), strict=True))
            assert not torch.equal(ahead[packed.layers.index(down)],
                                   before[packed.layers.index(down)])

            # kept for the rank's next switch only while no write of ours came between
            writes = state.writes
            seq = writes.seq
            assert writes.offer(packed.prebuild(2, seq, pieces, 1 << 30), seq, lambda: True)
            with writes.writing():
                with writes.writing():  # a put-back inside a failed apply: still writing
                    assert writes.seq % 2 == 1
                assert writes.seq % 2 == 1
            assert writes.seq == seq + 2
            assert writes.take(2) is None
            assert packed.status()["prebuilt_discarded"] == 1
            built = packed.prebuild(3, writes.seq, pieces, 1 << 30)
            assert not writes.offer(built, seq, lambda: True)  # packed from older weights
            assert packed.status()["prebuilt_discarded"] == 2
            assert writes.offer(built, writes.seq, lambda: True)
            assert writes.take(3) is not None and seq != writes.seq
        assert packed.status()["prebuilt_used"] == 1
    finally:
        state.poller.close()


def test_only_layers_vllm_packed_are_refreshed() -> None:
    """``reads_its_weight`` tells a kernel computing from the weight it is given (torch's linear,
    vLLM's fallback where it packs nothing) from one reading a copy made at load; with vLLM's
    real dispatch on this host, ``install_packed`` marks a layer for refresh exactly when vLLM
    packed it, and either way the layer computes from its written weight once refreshed."""
    import torch.nn.functional as F

    from vllm_deltasync.server.vllm.cpu_gemm import install_packed, reads_its_weight
    from vllm_deltasync.server.worker.packed import REPACK_ATTR

    w = torch.randn(32, 16).to(torch.bfloat16)
    copy = w.clone()

    def broken(x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
        raise RuntimeError("no kernel")

    assert reads_its_weight(lambda x, weight, bias: F.linear(x, weight, bias), w)
    assert not reads_its_weight(lambda x, weight, bias: F.linear(x, copy, bias), w)
    assert not reads_its_weight(broken, w)  # in doubt: treated as packed (always correct)

    layer = torch.nn.Linear(128, 256, bias=False).to(torch.bfloat16).requires_grad_(False)
    install_packed(vllm_cpu_dispatch(), layer)
    marked = getattr(layer, REPACK_ATTR, None) is not None
    assert marked == vllm_packs_bf16_linears()
    x = torch.randn(3, 128).to(torch.bfloat16)
    layer.weight.add_(1.0)  # a switch's in-place write
    if marked:
        layer.cpu_linear = getattr(layer, REPACK_ATTR)()
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None).float(),
                               F.linear(x, layer.weight).float(), rtol=2e-2, atol=2e-1)

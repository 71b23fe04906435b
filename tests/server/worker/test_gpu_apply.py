"""A ~1% delta applied to 7B-shaped tensors at TP=2 (one rank), timed; torch only, no vLLM.

The shard maps are the ones vLLM's loaders produce (``data/*.json``, kept honest by
``test_recorded_maps.py``), widened from one recorded decoder layer to the model's depth. For
every checkpoint tensor: a random full tensor is "loaded" into the rank's parameters through the
map, a random 1% of its elements change, and the patch goes host -> device, through
``translate`` and ``apply_patches``; afterwards the rank's parameters must equal the new full
tensor seen through the map, bit for bit. Timings use CUDA events and are printed
(``pytest -s``). The CPU variant runs the same code on one layer's worth of tensors so CI
exercises it everywhere (a column-parallel, a row-parallel and replicated tensors).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.server.worker.apply import apply_patches, prepare
from vllm_deltasync.server.worker.shardmap import ShardMap

DATA = Path(__file__).resolve().parents[2] / "data" / "shardmaps"
LAYERS = {"llama2_7b": 32, "qwen2_7b": 28}
DENSITY = 0.01


def widened_map(kind: str, rank: int, layers: int, device: str) -> ShardMap:
    """The recorded one-layer map repeated ``layers`` times, bound to fresh parameters."""
    raw = json.loads((DATA / f"{kind}_tp2_rank{rank}.json").read_text())
    for key in ("checkpoint_params", "targets", "params"):
        wide = {}
        for name, value in raw[key].items():
            for i in range(layers if "layers.0." in name else 1):
                wide[name.replace("layers.0.", f"layers.{i}.")] = json.loads(
                    json.dumps(value).replace("layers.0.", f"layers.{i}.")
                )
        raw[key] = wide
    params = {
        name: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        for name, (shape, dtype) in raw["params"].items()
    }
    return ShardMap.from_json(json.dumps(raw), params)


class Clock:
    """Milliseconds between marks: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.totals: dict[str, float] = {}

    def time(self, label: str, fn: Callable[[], object]) -> object:
        if self.cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            stop.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(stop)
        else:
            t0 = time.perf_counter()
            out = fn()
            ms = (time.perf_counter() - t0) * 1e3
        self.totals[label] = self.totals.get(label, 0.0) + ms
        return out


def _block_views(shardmap: ShardMap, name: str, full: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(param view, checkpoint view) per block: what the loader would have copied."""
    flat = full.reshape(-1)
    pairs = []
    for t in shardmap.targets(name):
        b, dst = t.block, t.param.view(-1)
        pairs.append((
            dst.as_strided(b.sizes, b.dst_strides, dst.storage_offset() + b.dst_offset),
            flat.as_strided(b.sizes, b.src_strides, flat.storage_offset() + b.src_offset),
        ))
    return pairs


def run_delta(shardmap: ShardMap, device: str, names: list[str], relative: bool) -> dict[str, float]:
    gen = torch.Generator(device=device).manual_seed(0)
    clock, changed = Clock(device), 0
    pin = device.startswith("cuda")
    for name in names:
        shape = shardmap.shape(name)
        full = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
        for dst, src in _block_views(shardmap, name, full):
            dst.copy_(src)  # the load
        flat = full.view(-1)
        idx = (torch.rand(flat.numel(), generator=gen, device=device) < DENSITY).nonzero().squeeze(1)
        new = flat.clone()
        new[idx] = torch.randn(idx.numel(), generator=gen, device=device).to(torch.bfloat16)
        values = (new[idx].view(torch.int16) - flat[idx].view(torch.int16)) if relative else new[idx]
        host_idx, host_values = idx.cpu(), values.cpu()
        if pin:
            host_idx, host_values = host_idx.pin_memory(), host_values.pin_memory()
        changed += idx.numel()
        patch = TensorPatch(name, shape, host_idx, host_values, relative=relative)
        dev_patch = clock.time("h2d", lambda p=patch: TensorPatch(
            p.name, p.shape, p.indices.to(device, non_blocking=True),
            p.values.to(device, non_blocking=True), relative=p.relative))
        pieces = clock.time("translate", lambda p=dev_patch: prepare(shardmap.translate(p)))
        clock.time("apply", lambda ps=pieces: apply_patches(ps))
        for dst, src in _block_views(shardmap, name, new.view(shape)):
            assert torch.equal(dst.view(torch.int16), src.view(torch.int16)), name
    return {**clock.totals, "changed": float(changed)}


def _report(kind: str, device: str, names: list[str], relative: bool, stats: dict[str, float]) -> None:
    print(
        f"\n{kind} TP=2 rank=0 {device} {'relative' if relative else 'absolute'}: "
        f"{len(names)} tensors, {int(stats['changed'])} changed elements (checkpoint coords), "
        f"h2d {stats['h2d']:.1f} ms, translate {stats['translate']:.1f} ms, "
        f"apply {stats['apply']:.1f} ms"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("kind", ["llama2_7b", "qwen2_7b"])
def test_gpu_apply_7b_delta(kind: str, relative: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    shardmap = widened_map(kind, 0, LAYERS[kind], "cuda")
    names = shardmap.names
    run_delta(shardmap, "cuda", names[:3], relative)  # warm-up (kernels, allocator)
    stats = run_delta(shardmap, "cuda", names, relative)
    _report(kind, "cuda", names, relative, stats)


@pytest.mark.parametrize("relative", [False, True])
def test_cpu_apply_7b_layer_delta(relative: bool) -> None:
    shardmap = widened_map("llama2_7b", 0, 1, "cpu")
    names = [n for n in shardmap.names if n.endswith(("k_proj.weight", "o_proj.weight", "norm.weight"))]
    stats = run_delta(shardmap, "cpu", names, relative)
    _report("llama2_7b (k_proj, o_proj, norms of one layer)", "cpu", names, relative, stats)


def _budget_case(device: str) -> tuple[ShardMap, dict[str, torch.Tensor], list]:
    """One layer of the recorded map on ``device``, each tensor loaded and a 1% delta staged
    through ``translate`` (host patches, as the poller stages them)."""
    from vllm_deltasync.server.worker.apply import compact

    shardmap = widened_map("llama2_7b", 0, 1, device)
    gen = torch.Generator().manual_seed(3)
    new_full, staged = {}, []
    for name in shardmap.names[:6]:
        full = torch.randn(shardmap.shape(name), generator=gen).to(torch.bfloat16)
        for dst, src in _block_views(shardmap, name, full.to(device)):
            dst.copy_(src)
        flat = full.view(-1)
        idx = (torch.rand(flat.numel(), generator=gen) < DENSITY).nonzero().squeeze(1)
        new = flat.clone()
        new[idx] = torch.randn(idx.numel(), generator=gen).to(torch.bfloat16)
        new_full[name] = new.view(full.shape)
        staged += compact(shardmap.translate(TensorPatch(name, full.shape, idx, new[idx])))
    return shardmap, new_full, staged


def test_device_budget_leaves_host_parameters_alone() -> None:
    from vllm_deltasync.server.worker.apply import device_nbytes, staged_nbytes

    shardmap, new_full, staged = _budget_case("cpu")
    pieces = prepare(staged, device_budget=0)
    assert device_nbytes(pieces) == 0 and staged_nbytes(pieces) == staged_nbytes(staged)
    apply_patches(pieces)
    for name, new in new_full.items():
        for dst, src in _block_views(shardmap, name, new):
            assert torch.equal(dst, src), name


@pytest.mark.gpu
def test_device_budget_stages_the_rest_pinned_and_copies_at_the_switch() -> None:
    """``max_device_staged_bytes``: pieces past the budget wait in pinned host memory; the
    switch copies them and every element lands. Pause each way printed (``pytest -s``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from vllm_deltasync.server.worker.apply import device_nbytes, staged_nbytes

    for fraction in (1.0, 0.5, 0.0):
        shardmap, new_full, staged = _budget_case("cuda")
        total = staged_nbytes(staged)
        budget = int(total * fraction)
        pieces = prepare(staged, device_budget=budget)
        on_device = device_nbytes(pieces)
        assert on_device <= budget and (fraction < 1.0 or on_device == total)
        host = [p for p in pieces if p.values.device.type == "cpu"]
        assert all(p.values.is_pinned() for p in host)
        assert bool(host) == (on_device < total)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        apply_patches(pieces)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        print(f"\ndevice budget {fraction:.0%} of {total} staged bytes: apply {ms:.2f} ms")
        for name, new in new_full.items():
            for dst, src in _block_views(shardmap, name, new.cuda()):
                assert torch.equal(dst, src), (fraction, name)

"""Peer benchmark: our in-place apply vs vLLM's own two ways to change weights in a running engine.

One engine (TP=1, the extension configured by environment variables) follows a ``file://``
bucket: bench_apply's engine of the same model, handed over when that section ran just before
(one engine start less), else a new one. For each density (~0.5% and ~3% of the elements, flipped by 1-3 bf16 ulps as RL steps
are; REFERENCE §1) the trainer side publishes three deltas; the engine applies each one, and
the last one is then written again, on the same engine and from memory, by:

* **ours**: the rank's scatter of the staged step (``last_apply.apply_s``, median of the three
  deltas), and the engine core's whole switch pause;
* **vLLM's sparse patch loader**: ``load_checkpoint_weight_patches`` with that delta's changed
  elements (checkpoint-coordinate indices and values, built before timing), the path vLLM's
  own sparse weight updates use; it goes through each model's ``load_weights`` (so any TP/EP),
  staging a full NaN-filled tensor per patched tensor;
* **vLLM's reload**: ``model_runner.reload_weights`` with that step's full tensors.

The peers are called past the extension's watch of ``reload_weights`` and ``load_weights``,
so the rank does not resync after them; they write the values the weights already hold, and the
digests are checked against the step's checkpoint afterwards. Peak extra RSS: the worker's
VmHWM growth during each call.

**Memory floor** of a scatter: every 64-byte cache line holding a changed element is read and
written back once (128 B per line), plus the staged pieces are read once; divided by the copy
bandwidth measured in the same worker (``dst.copy_(src)`` of 256 MiB, best of 5, bytes read
plus written). Lines are counted in checkpoint coordinates, which the runtime layout keeps per
row (fused tensors concatenate rows).

    .venv/bin/python benchmarks/bench_peers.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_apply import _proc_status, _reset_peak, engine_env, follower

DENSITIES = (0.005, 0.03)
DELTAS_PER_DENSITY = 3
REPEATS = 3
LINE = 64


def _worker_peers(worker: Any, prev_path: str, new_path: str, repeats: int) -> dict[str, Any]:
    """Runs inside the worker (sent by value with cloudpickle): both peers, and the memory
    floor's inputs (cache lines touched, copy bandwidth)."""
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    prev, new = load_file(prev_path), load_file(new_path)
    patches, lines, changed = [], 0, 0
    for name, t in new.items():
        flat = t.reshape(-1)
        idx = (flat.view(torch.int16) != prev[name].reshape(-1).view(torch.int16)).nonzero()
        idx = idx.squeeze(1)
        if idx.numel():
            per_line = LINE // t.element_size()
            lines += int(torch.unique_consecutive(idx // per_line).numel())
            changed += int(idx.numel())
            patches.append(CheckpointWeightPatch(name, tuple(t.shape), t.dtype,
                                                 flat[idx].clone(), idx))
    runner = worker.model_runner
    model = runner.model
    pid = os.getpid()

    def timed(fn: Any) -> tuple[float, int]:
        times, peak = [], 0
        for _ in range(repeats):
            _reset_peak(pid)
            before = _proc_status("VmRSS", pid)
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
            peak = max(peak, _proc_status("VmHWM", pid) - before)
        return statistics.median(times), peak

    # past the extension's watch of load_weights (an instance attribute over the class's)
    watched = model.__dict__.pop("load_weights", None)
    try:
        with set_current_vllm_config(worker.vllm_config), torch.no_grad():
            patch_s, patch_peak = timed(lambda: load_checkpoint_weight_patches(model, patches))
            reload_s, reload_peak = timed(lambda: type(runner).reload_weights(
                runner, weights_iterator=iter(new.items()), is_checkpoint_format=True))
    finally:
        if watched is not None:
            model.load_weights = watched
    src = torch.empty(128 << 20, dtype=torch.int16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_copy_once(src, dst) for _ in range(5))
    return {"patch_s": patch_s, "patch_peak": patch_peak, "reload_s": reload_s,
            "reload_peak": reload_peak, "lines": lines, "changed": changed,
            "copy_bw": 2 * src.numel() * src.element_size() / best}


def _copy_once(src: Any, dst: Any) -> float:
    started = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - started


def _measure(name: str, tmp: Path, densities: tuple[float, ...]) -> list[dict[str, Any]]:
    """One row per density, all on one follower (bench_apply's, when it handed it over)."""
    import cloudpickle
    from safetensors.torch import save_file

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    f = follower(name)
    rows = []
    try:
        for density in densities:
            scatters, pauses = [], []
            for _ in range(DELTAS_PER_DENSITY):
                prev = str(tmp / f"{name}-prev.safetensors")
                save_file(f.tensors, prev)
                status = f.publish(density)
                switch = f.llm.llm_engine.engine_core.call_utility(
                    "deltasync_engine_status")["switches"][-1]
                scatters.append(status["last_apply"]["apply_s"])
                pauses.append(switch["pause_s"])
            new = str(tmp / f"{name}-step{f.step}.safetensors")
            save_file(f.tensors, new)
            peers = f.llm.collective_rpc(_worker_peers, args=(prev, new, REPEATS))[0]
            live = f.llm.collective_rpc("deltasync_weight_digests")[0]
            want = f.llm.collective_rpc("deltasync_checkpoint_digests", args=(new,))[0]
            rows.append({"name": name, "params": sum(t.numel() for t in f.tensors.values()),
                         "density": density, "scatter_s": statistics.median(scatters),
                         "pause_s": statistics.median(pauses),
                         "staged_bytes": status["last_apply"]["staged_bytes"],
                         "equal": live == want, **peers})
    finally:
        f.close()
    return rows


def run(quick: bool = False) -> str:
    """Markdown section: one row per density, all on one engine."""
    name = "llama-22M" if quick else "llama-160M"
    densities = DENSITIES[:1] if quick else DENSITIES
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        engine_env(tmp)
        rows = _measure(name, Path(tmp), densities)
    lines = [
        "## peers: our apply vs vLLM's sparse patch loader and reload (same engine, same delta)",
        "",
        "| model | changed | ours: scatter | ours: switch pause | memory floor | scatter / floor "
        "| `load_checkpoint_weight_patches` | / our scatter | : peak extra RSS "
        "| `reload_weights` | / our scatter | : peak extra RSS | digests after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        floor = (r["lines"] * 2 * LINE + r["staged_bytes"]) / r["copy_bw"]
        lines.append(
            f"| {r['name']} ({r['params'] / 1e6:.0f}M) | {r['changed'] / r['params']:.2%} "
            f"| {r['scatter_s'] * 1e3:.2f} ms | {r['pause_s'] * 1e3:.2f} ms "
            f"| {floor * 1e3:.2f} ms | {r['scatter_s'] / floor:.1f}x "
            f"| {r['patch_s'] * 1e3:.1f} ms | {r['patch_s'] / r['scatter_s']:.0f}x "
            f"| {r['patch_peak'] / 2**20:.0f} MiB "
            f"| {r['reload_s'] * 1e3:.1f} ms | {r['reload_s'] / r['scatter_s']:.1f}x "
            f"| {r['reload_peak'] / 2**20:.0f} MiB | {'equal' if r['equal'] else 'DIFFER'} |")
    bw = rows[0]["copy_bw"] / 1e9
    lines += [
        "",
        f"Ours: median of {DELTAS_PER_DENSITY} deltas per density (the rank's scatter of the "
        "staged step; the pause adds the engine core's broadcast and reply). Peers: median of "
        f"{REPEATS} calls writing the last delta again from memory. Memory floor: cache lines "
        f"holding a changed element x 128 B (read and write back) plus the staged bytes, at the "
        f"worker's measured copy bandwidth ({bw:.1f} GB/s, read plus written). Digests after: "
        "the live weights against that step's checkpoint, once both peers ran. CPU build, "
        "`cpu_kernels=inplace`: the in-place path GPUs use (docs/extension.md).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small model, one density")
    print(run(quick=parser.parse_args().quick))


if __name__ == "__main__":
    main()

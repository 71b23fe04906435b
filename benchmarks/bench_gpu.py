"""The GPU rows of every benchmark, in one script (at most ~5 minutes on one GPU).

Where a CUDA device is present it runs, and reports each row's own seconds:

1. **The publisher's diff on the device** (trainer/diff.py, ``previous_on="device"``): a 1%
   step of 7B-shaped bf16 tensors (one Llama-2-7B decoder layer x 8, ~1.6B elements): compare,
   gather and baseline update, and the copy of the changes to the host; effective GB/s over
   4 bytes per element, beside a device-to-host copy of the same tensors (the snapshot the
   publisher took before 0.5). That rate is the one ``bench_scale`` assumes (DEVICE_DIFF_GBPS).
2. **bench_publisher's snapshot-floor row** with the model on the GPU.
3. **bench_codec's GPU decode + apply** of a 1% step of 7B shapes.
4. **The apply pause on a real engine** (bench_apply) where vLLM's GPU build is installed.
5. The tests marked ``gpu`` (``pytest -m gpu``): pass/fail counts.

Without a CUDA device every row says "not run". Writes its section of RESULTS.md through the
runner: ``python -m benchmarks.run --only gpu --merge``.

    .venv/bin/python -m benchmarks.bench_gpu [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("publisher diff on the device (7B shapes, 1% changed)",
        "publish() against the snapshot floor, model on the GPU",
        "decode + apply of a 1% step (7B shapes)",
        "apply pause on a real engine (vLLM GPU build)",
        "tests marked gpu")


def _timed(fn: Any) -> tuple[str, float]:
    started = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - one row failing must not hide the others
        out = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    return out, time.perf_counter() - started


def device_diff(quick: bool, device: str = "cuda") -> str:
    """The device path of the publisher's diff on 7B-shaped tensors (``device="cpu"``: the
    same code on the CPU, as the tests smoke it)."""
    from vllm_deltasync.trainer.diff import Differ

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    h, inter = (1024, 2752) if quick else (4096, 11008)
    layers = 2 if quick else 8
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(h, h)] * 4 + [(inter, h), (inter, h), (h, inter)]
    tensors = {f"l{i}.{j}": torch.randn(s, device=device, generator=gen).to(torch.bfloat16)
               for i in range(layers) for j, s in enumerate(shapes)}
    n = sum(t.numel() for t in tensors.values())
    differ = Differ(previous_on="device", device_path=True)
    differ.diff_all(tensors, full=True)
    rows = []
    for step in range(4):
        for t in tensors.values():  # 1% of the elements move
            pick = torch.randint(0, t.numel(), (t.numel() // 100,), device=device, generator=gen)
            t.view(-1)[pick] += 1e-2
        sync()
        started = time.perf_counter()
        diffs = differ.diff_all(tensors, full=False)
        sync()
        diff_s = time.perf_counter() - started
        started = time.perf_counter()
        for t in tensors.values():
            t.to(torch.bfloat16).to("cpu", copy=True)
        snap_s = time.perf_counter() - started
        changed = sum(d.changed for d in diffs.values())
        if step:
            rows.append((diff_s, snap_s, changed))
    diff_s, snap_s, changed = min(rows)
    return (
        f"{n / 1e9:.2f}B bf16 elements in {len(tensors)} tensors, {changed / n * 100:.2f}% changed: "
        f"diff on the device (compare + gather + baseline update + changes to the host) "
        f"{diff_s * 1e3:.1f} ms = {n * 4 / diff_s / 1e9:.0f} GB/s effective over 4 B per element; "
        f"device-to-host snapshot of the same tensors (the publisher before 0.5) {snap_s * 1e3:.1f} ms "
        f"({snap_s / diff_s:.1f}x the diff). Best of 3 steps; device: "
        f"{torch.cuda.get_device_name() if device == 'cuda' else device}.")


def publisher_floor(quick: bool) -> str:
    from benchmarks import bench_publisher

    return bench_publisher.run(quick=quick, device="cuda").split("\n\n", 2)[-1].strip()


def codec_gpu(quick: bool) -> str:
    from benchmarks import bench_codec

    return bench_codec.gpu_apply_section(quick).split("\n\n", 1)[-1].strip()


def engine_apply(quick: bool) -> str:
    if importlib.util.find_spec("vllm") is None:
        return "not run: vLLM is not installed"
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return "not run: the installed vLLM is not its CUDA build"
    from benchmarks import bench_apply

    return bench_apply.run(quick=True, hand_over_last=False).strip()


def gpu_tests(quick: bool) -> str:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                           "tests"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    last = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1:] or ["(no output)"]
    return f"`pytest -m gpu tests`: {last[0]} (exit {proc.returncode})"


def run(quick: bool = False) -> str:
    head = "### GPU rows\n\n| row | status | seconds |\n|---|---|---:|\n"
    if not torch.cuda.is_available():
        return head + "".join(f"| {r} | not run: no CUDA device on this machine | - |\n" for r in ROWS)
    table, details = head, []
    for row, fn in zip(ROWS, (device_diff, publisher_floor, codec_gpu, engine_apply, gpu_tests),
                       strict=True):
        text, seconds = _timed(lambda fn=fn: fn(quick))
        status = text if text.startswith(("not run", "failed")) else "ok"
        table += f"| {row} | {status[:200]} | {seconds:.0f} |\n"
        if status == "ok":
            details.append(f"#### {row}\n\n{text}\n")
    return table + "\n" + "\n".join(details)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the GPU rows of every benchmark")
    parser.add_argument("--quick", action="store_true", help="smaller tensors")
    print(run(quick=parser.parse_args().quick))

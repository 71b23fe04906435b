"""The 1T MoE scale-model benchmark in quick mode (1 layer, 2 routed experts + the shared one)."""

from __future__ import annotations

import re

from benchmarks import bench_scale
from benchmarks import run as bench_run


def test_bench_scale_quick_prints_measured_and_extrapolated_rows() -> None:
    assert "scale" in bench_run.BENCHMARKS
    text = bench_scale.run(quick=True)
    measured = [line for line in text.splitlines() if re.match(r"\| sparse-v\d \| \d+ \|", line)]
    assert len(measured) >= 1
    for line in measured:  # requests were counted at the server, bytes were fetched
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert int(cells[4].split()[0]) > 0 and not cells[5].startswith("0.0 MB")
    layout = re.search(r"\n\| 772 \| \d+ \| [\d.]+ [MG]B \| (\d+) \(", text)  # 1 layer, all experts
    assert layout is not None and int(layout.group(1)) > 2  # the manifest and the rank's ranges
    assert "| DeepSeek-V3 (671B) | 8 (+1 shared) |" in text
    assert "| 1T (Kimi-K2 shape) | 12 (+1 shared) |" in text
    trainer = re.search(r"\| 1T \(Kimi-K2 shape\) \| 1\.\d\dT \| 39\.\dM \| .* \*\*([\d.]+)\*\* \|", text)
    assert trainer is not None and float(trainer.group(1)) > 0  # 1/256 of the parameters, 1%
    headline = re.search(r"1T MoE, 1% changed, trained on 256 GPUs, served at EP=32: ([\d.]+) s "
                         r"publish -> applied on GPU servers \(([\d.]+) s with the CPU build", text)
    assert headline is not None and 0 < float(headline.group(1)) < float(headline.group(2))
    assert "**Measured on this machine**" in text and "**Assumed trainer**" in text
    assert "bit-exact vs the trainer's new tensors: asserted" in text


def test_bench_gpu_rows_say_not_run_without_cuda_and_its_diff_runs_on_cpu() -> None:
    import torch

    from benchmarks import bench_gpu

    assert "gpu" in bench_run.BENCHMARKS
    text = bench_gpu.run(quick=True)
    if not torch.cuda.is_available():
        assert text.count("not run: no CUDA device") == len(bench_gpu.ROWS)
    row = bench_gpu.device_diff(quick=True, device="cpu")  # the same code as on the GPU
    changed = re.search(r"elements in 14 tensors, ([\d.]+)% changed", row)
    assert changed is not None and 0.5 < float(changed.group(1)) <= 1.0

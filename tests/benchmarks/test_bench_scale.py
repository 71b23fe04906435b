"""The 1T MoE scale-model benchmark in quick mode (1 layer, 2 routed experts + the shared one)."""

from __future__ import annotations

import re

from benchmarks import bench_scale
from benchmarks import run as bench_run


def test_bench_scale_quick_prints_measured_rows_the_model_and_its_sensitivity() -> None:
    from benchmarks import scale_model

    assert "scale" in bench_run.BENCHMARKS
    text = bench_scale.run(quick=True)
    measured = [line for line in text.splitlines() if re.match(r"\| sparse-v\d \| \d+ \|", line)]
    assert len(measured) >= 1
    for line in measured:  # requests were counted at the server, bytes were fetched
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert int(cells[4].split()[0]) > 0 and not cells[5].startswith("0.0 MB")
    layout = re.search(r"\n\| 772 \| \d+ \| [\d.]+ [MG]B \| (\d+) \(", text)  # 1 layer, all experts
    assert layout is not None and int(layout.group(1)) > 2  # the manifest and the rank's ranges
    # the plan of EP rank 0 measured on the full-size manifests: every tensor of the model listed,
    # the rank's experts (384 / 32 = 12 of each MoE layer) and every other tensor selected
    plan = re.search(r"\| 1T \(Kimi-K2 shape\) \| 69,975 \| [\d.]+ MB \| 3,015 \| ([\d.]+) \(([\d.]+)\) \| 1 \|", text)
    assert plan is not None and float(plan.group(1)) > 0 and float(plan.group(2)) > 0
    assert re.search(r"\| DeepSeek-V3 \(671B\) \| 45,395 \| [\d.]+ MB \| 2,243 \|", text)
    assert "| DeepSeek-V3 (671B) | 8 (+1 shared) |" in text
    rollout = re.search(r"\| 1T \(Kimi-K2 shape\) \| 12 \(\+1 shared\) \| .* \| ([\d.]+) \| [\d.]+ \| "
                        r"[\d.]+ \([\d.]+\) \| \*\*([\d.]+)\*\* \(([\d.]+)\) \|", text)
    assert rollout is not None and float(rollout.group(1)) == float(plan.group(1))  # the measured plan
    trainer = re.search(r"\| 1T \(Kimi-K2 shape\) \| 1\.0\dT \| 40\.\dM \| .* \*\*([\d.]+)\*\* \|", text)
    assert trainer is not None and float(trainer.group(1)) > 0  # 1/256 of the parameters, 1%
    headline = re.search(r"1T MoE, 1% changed, trained on 256 GPUs, served at EP=32: ([\d.]+) s "
                         r"publish -> applied on GPU servers \(([\d.]+) s with the CPU build", text)
    assert headline is not None and 0 < float(headline.group(1)) < float(headline.group(2))
    assert headline.group(1) == rollout.group(2) and headline.group(2) == rollout.group(3)
    # every assumption is listed with the total at half and at twice its value; halving a
    # latency or doubling a rate never makes the step slower
    total = float(headline.group(1))
    rows = re.findall(r"\n\| `(\w+)` \| [^|]+\|[^|]+\| ([\d.]+) \([\d.]+\) \| ([\d.]+) \([\d.]+\) \|", text)
    sens = {name: (float(half), float(double)) for name, half, double in rows}
    assert set(sens) == set(scale_model.ASSUMED)
    for name, (half, double) in sens.items():  # a latency or a count of rounds: more is slower
        faster, slower = (half, double) if name.endswith(("_s", "_requests")) else (double, half)
        assert faster <= total + 0.05 and total <= slower + 0.05, (name, half, total, double)
    assert sens["request_s"][0] < total < sens["request_s"][1]
    assert "**Measured on this machine**" in text and "**Assumed**" in text
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

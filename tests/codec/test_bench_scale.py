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
    assert "| DeepSeek-V3 (671B) | 8 (+1 shared) | 58 |" in text
    assert "| 1T (Kimi-K2 shape) | 12 (+1 shared) | 60 |" in text
    assert re.search(r"1T MoE, 1% changed, EP=32: [\d.]+ GB fetched per node per step, \d+ s "
                     r"publish -> applied at \d+ Gb/s \(extrapolated", text)
    assert "bit-exact vs the trainer's new tensors: asserted" in text

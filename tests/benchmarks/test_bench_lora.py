"""benchmarks/bench_lora.py's trainer-side measurement on a tiny layer: its tables come from
real training steps and real publishers (the numbers are the benchmark's, not asserted here
beyond what must hold: a larger learning rate changes more of the merged weights)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft", reason="the LoRA tests need peft (the 'lora' extra)")

from benchmarks.bench_lora import LRS, RANKS, Case, bytes_table, measure, sparsity_table  # noqa: E402


def test_the_lora_benchmark_measures_both_modes(tmp_path: Path) -> None:
    runs = measure([Case("layer-64", 64, 1, 0, warmup=1, steps=2)], tmp_path)
    assert set(runs) == {("layer-64", r, lr) for r in RANKS for lr in LRS}
    for rank in RANKS:
        merged = [sum(runs["layer-64", rank, lr].merged) for lr in LRS]
        assert merged == sorted(merged) and merged[-1] > 0
        for lr in LRS:
            run = runs["layer-64", rank, lr]
            assert len(run.merged) == len(run.lora_b) == 2
            assert [len(run.bytes[mode]) for mode in ("merged", "adapter")] == [2, 2]
            assert run.elements["merged"] == 64 * 64 and run.elements["adapter"] == 2 * 64 * rank
    assert sparsity_table(runs).count("| layer-64 |") == 6
    assert bytes_table(runs).count("| layer-64 |") == 6

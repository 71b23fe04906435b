"""The benchmark code paths that the suite's entry point runs, on tiny sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import run as bench_run
from benchmarks.bench_codec import _tp_local, gpu_apply_table


def test_apply_path_checks_its_own_bits_on_cpu() -> None:
    table = gpu_apply_table("cpu", quick=True)
    assert "| decode ms |" in table and "checked" in table


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_apply_path_on_gpu() -> None:
    assert "decode GB/s" in gpu_apply_table("cuda", quick=True)


@pytest.mark.parametrize("dim", [0, 1])
def test_tp_translation_matches_slicing(dim: int) -> None:
    shape, tp = (6, 8), 2
    full = torch.arange(48).view(shape)
    idx = torch.tensor([0, 5, 13, 20, 27, 30, 47])
    for rank in range(tp):
        keep, local = _tp_local(idx, shape, dim, rank, tp)
        shard = full.chunk(tp, dim=dim)[rank].contiguous().view(-1)
        assert torch.equal(shard[local], idx[keep])
        assert set(shard.tolist()) >= set(idx[keep].tolist())


def test_runner_skips_missing_benchmarks_and_writes_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench_run.BENCHMARKS, "nonexistent", "a benchmark nobody wrote")
    out = tmp_path / "RESULTS.md"
    assert bench_run.main(["--only", "nonexistent", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| nonexistent | skipped |" in text and "not written yet" in text
    assert "- machine: " in text and "--only nonexistent" in text


def test_merge_replaces_one_section_and_keeps_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "RESULTS.md"
    monkeypatch.setitem(bench_run.BENCHMARKS, "nonexistent", "a benchmark nobody wrote")
    monkeypatch.setitem(bench_run.BENCHMARKS, "zzmissing", "another")
    assert bench_run.main(["--only", "nonexistent,zzmissing", "--out", str(out)]) == 0
    text = out.read_text().replace("not written yet (", "OLD BODY (", 1)
    out.write_text(text)
    assert bench_run.main(["--only", "zzmissing", "--out", str(out), "--merge"]) == 0
    merged = out.read_text()
    assert merged.count("## nonexistent\n") == 1 and merged.count("## zzmissing\n") == 1
    assert "OLD BODY" in merged.split("## zzmissing")[0]  # the other section is kept as it was
    assert "not written yet" in merged.split("## zzmissing")[1]  # this one is new
    assert "zzmissing re-run alone on" in merged and "| nonexistent | skipped |" in merged
    assert merged.startswith("# Benchmark results\n") and "- machine: " in merged

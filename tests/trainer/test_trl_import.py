"""A bucket in TRL's delta-sync layout is converted and followed, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from tests.helpers.transports import S3_CREDENTIALS
from vllm_deltasync._loop import run_sync
from vllm_deltasync.cli import main
from vllm_deltasync.errors import ChainError, FormatError
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.trainer.publisher import DeltaPublisher
from vllm_deltasync.trainer.trl_import import TrlImporter, parse_trl_path, plan_replay

SHAPES = {"model.embed_tokens.weight": (50, 16), "model.layers.0.mlp.down_proj.weight": (16, 40), "model.norm.weight": (16,)}



def trl_file(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    return save(tensors, metadata=meta)


def trl_delta_meta(step: int, changed: list[str], total: int, nnz: int) -> dict[str, str]:
    """Header metadata as TRL's delta sync writes it."""
    return {
        "format": "sparse_weight_patch",
        "version": "1",
        "sparse": "true",
        "model_version": str(step),
        "sparsity": f"{1 - nnz / total:.6f}",
        "changed_params": json.dumps(changed),
        "total_params": str(total),
        "changed_elements": str(nnz),
    }

class TrlTrainer:
    """Writes steps the way TRL's delta sync does: anchors every N, absolute-value deltas."""

    def __init__(self, root: Path, anchor_every: int = 4, seed: int = 0) -> None:
        self.root, self.anchor_every = root, anchor_every
        self.g = torch.Generator().manual_seed(seed)
        self.w = {k: (torch.randn(s, generator=self.g) * 0.02).to(torch.bfloat16) for k, s in SHAPES.items()}
        self.history: dict[int, dict[str, torch.Tensor]] = {}

    def step(self, step: int) -> None:
        delta: dict[str, torch.Tensor] = {}
        for name, t in self.w.items():
            flat = t.view(-1)
            idx = torch.randperm(flat.numel(), generator=self.g)[: max(1, flat.numel() // 30)].sort().values
            flat.view(torch.int16)[idx] += 1
            delta[f"{name}.indices"] = idx.to(torch.int32)
            delta[f"{name}.values"] = flat[idx].clone()
        self.history[step] = {k: v.clone() for k, v in self.w.items()}
        if step % self.anchor_every == 0:
            self._write(f"anchors/step_{step:06d}.safetensors", {k: v.clone() for k, v in self.w.items()},
                        {"format": "full", "model_version": str(step)})
        else:
            nnz = sum(t.numel() for k, t in delta.items() if k.endswith(".values"))
            meta = trl_delta_meta(step, list(self.w), sum(t.numel() for t in self.w.values()), nnz)
            self._write(f"deltas/step_{step:06d}.safetensors", delta, meta)

    def _write(self, rel: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(trl_file(tensors, meta))


def _read_full(url: str, step: int) -> dict[str, torch.Tensor]:
    async def go() -> dict[str, torch.Tensor]:
        async with BucketReader.open(url) as reader:
            return await reader.read_full(step)

    return run_sync(go())


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)), k


def test_cli_converts_every_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = TrlTrainer(tmp_path / "trl")
    for step in range(7):
        trainer.step(step)
    dst = f"file://{tmp_path}/ours"
    assert main(["import-trl", f"file://{tmp_path}/trl", dst, "--anchor-every", "3"]) == 0
    assert "imported 7 steps (0..6)" in capsys.readouterr().out
    for step in range(3, 7):  # retention (2 anchors) has removed steps 0-2
        _assert_same(_read_full(dst, step), trainer.history[step])


def test_follow_publishes_only_new_steps(tmp_path: Path) -> None:
    trainer = TrlTrainer(tmp_path / "trl")
    dst = f"file://{tmp_path}/ours"
    for step in range(3):
        trainer.step(step)
    with DeltaPublisher(dst, codec="sparse-v2") as pub:
        importer = TrlImporter(f"file://{tmp_path}/trl", pub)
        assert importer.import_new() == [0, 1, 2]
        assert importer.import_new() == []
        for step in range(3, 6):
            trainer.step(step)
        assert importer.import_new() == [3, 4, 5]
    trainer.step(6)
    with DeltaPublisher(dst, codec="sparse-v2") as pub:  # a restarted importer replays from anchor 4
        assert TrlImporter(f"file://{tmp_path}/trl", pub).import_new() == [6]
    for step in (2, 5, 6):
        _assert_same(_read_full(dst, step), trainer.history[step])


def test_plan_starts_at_newest_usable_anchor() -> None:
    files = [f for f in map(parse_trl_path, [
        "deltas/step_000001.safetensors", "anchors/step_000002.safetensors",
        "deltas/step_000002.safetensors", "deltas/step_000003.safetensors",
        "anchors/step_000004.safetensors", "deltas/step_000005.safetensors", "README.md",
    ]) if f is not None]
    assert [(f.step, f.kind) for f in plan_replay(files)] == [(2, "anchor"), (3, "delta"), (4, "anchor"), (5, "delta")]
    assert [f.step for f in plan_replay(files, after=4)] == [4, 5]
    assert plan_replay(files, after=5) == []
    with pytest.raises(ChainError, match="anchor"):
        plan_replay([f for f in files if f.kind == "delta"])


def test_foreign_delta_is_refused(tmp_path: Path) -> None:
    trainer = TrlTrainer(tmp_path / "trl")
    trainer.step(0)
    bad = {"x.indices": torch.tensor([0], dtype=torch.int32), "x.values": torch.zeros(1, dtype=torch.bfloat16)}
    (tmp_path / "trl/deltas").mkdir()
    (tmp_path / "trl/deltas/step_000001.safetensors").write_bytes(trl_file(bad, {"format": "other"}))
    with DeltaPublisher(f"file://{tmp_path}/ours") as pub, pytest.raises(FormatError, match="sparse_weight_patch"):
        TrlImporter(f"file://{tmp_path}/trl", pub).import_new()


def test_a_failed_import_resumes_where_it_stopped(tmp_path: Path) -> None:
    trainer = TrlTrainer(tmp_path / "trl")
    for step in range(4):
        trainer.step(step)
    delta2 = tmp_path / "trl/deltas/step_000002.safetensors"
    good = delta2.read_bytes()
    delta2.write_bytes(b"not a safetensors file")
    dst = f"file://{tmp_path}/ours"
    with DeltaPublisher(dst, codec="sparse-v2") as pub:
        importer = TrlImporter(f"file://{tmp_path}/trl", pub)
        with pytest.raises(FormatError, match="step_000002"):
            importer.import_new()
        assert pub.last_step == 1
        delta2.write_bytes(good)
        assert importer.import_new() == [2, 3]
    for step in (1, 3):
        _assert_same(_read_full(dst, step), trainer.history[step])


@pytest.mark.parametrize("scheme", ["hf", "s3"])
def test_import_from_a_network_bucket_closes_its_sessions(
        scheme: str, tmp_path: Path, request: pytest.FixtureRequest, run: Any) -> None:
    """``import-trl hf://... / s3://...`` in a subprocess with every warning shown: no
    "Unclosed client session" / ResourceWarning at exit, for a good import and a failed one."""
    import os
    import subprocess
    import sys

    trainer = TrlTrainer(tmp_path / "trl")
    for step in range(3):
        trainer.step(step)
    env = {**os.environ, "PYTHONWARNINGS": "always", "PYTHONDONTWRITEBYTECODE": "1"}
    if scheme == "hf":
        hub = request.getfixturevalue("hub")
        store = request.getfixturevalue("make_hf_store")()
        env.update(HF_ENDPOINT=hub.endpoint, HF_TOKEN=hub.token)
    else:
        store = request.getfixturevalue("make_s3_store")()
        env.update(AWS_ENDPOINT_URL=request.getfixturevalue("s3_endpoint"), AWS_REGION="us-east-1",
                   AWS_ACCESS_KEY_ID=S3_CREDENTIALS["aws_access_key_id"],
                   AWS_SECRET_ACCESS_KEY=S3_CREDENTIALS["aws_secret_access_key"])
    for path in sorted((tmp_path / "trl").rglob("*.safetensors")):
        run(store.write(str(path.relative_to(tmp_path / "trl")), path.read_bytes()))
    cli = Path(sys.executable).with_name("vllm-deltasync")

    def import_trl(dst: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(cli), "import-trl", store.url, dst], capture_output=True,
                              text=True, timeout=120, env=env)

    done = import_trl(f"file://{tmp_path}/ours")
    assert done.returncode == 0, done.stderr
    assert "imported 3 steps (0..2)" in done.stdout
    assert "Unclosed" not in done.stderr and "ResourceWarning" not in done.stderr, done.stderr
    _assert_same(_read_full(f"file://{tmp_path}/ours", 2), trainer.history[2])
    # a failed import (a corrupt delta) closes them too, and says why in one line
    run(store.write("deltas/step_000003.safetensors", b"not a safetensors file"))
    failed = import_trl(f"file://{tmp_path}/ours")
    assert failed.returncode == 1 and "step_000003" in failed.stderr
    assert "Unclosed" not in failed.stderr and "ResourceWarning" not in failed.stderr, failed.stderr
    assert "Traceback" not in failed.stderr

"""Buckets written by older publishers stay readable forever: format v1 (tests/data/v1, the v1
publisher) and format v2 (tests/data/v2, the 0.3.0 publisher), committed.

Each bucket must verify and every step must rebuild bit-exactly (per-tensor sha256 of the
bf16 bytes, recorded from the trainer when the buckets were written), through the reader and
through the ``verify`` / ``materialize`` commands.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from vllm_deltasync.cli.bucket import _run_materialize, _run_verify
from vllm_deltasync.format.reader import BucketReader

DATA = Path(__file__).resolve().parents[1] / "data"
EXPECTED: dict[str, dict[str, dict[str, str]]] = {
    f"v{version}/{codec}": steps
    for version in (1, 2)
    for codec, steps in json.loads((DATA / f"v{version}" / "expected.json").read_text()).items()
}
BUCKETS = sorted(EXPECTED)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.int16).numpy().tobytes()).hexdigest()


@pytest.fixture
def bucket(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A private copy (tests must never alter the committed data)."""
    name = request.param
    shutil.copytree(DATA / name, tmp_path / name)
    return f"file://{tmp_path / name}"


def test_every_codec_and_step_is_present() -> None:
    assert BUCKETS == ["v1/sparse-v1", "v1/sparse-v2", "v1/sparse-v2-zstd", "v2/sparse-v2", "v2/sparse-v3"]
    for name in BUCKETS:
        version, codec = name.split("/")
        manifests = json.loads((DATA / name / "manifests" / "000000000004.json").read_text())
        assert manifests["schema_version"] == int(version[1:])
        assert {t["encoding"] for t in manifests["tensors"]} == {codec}
        assert sorted(EXPECTED[name]) == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize("bucket", BUCKETS, indirect=True)
def test_old_bucket_verifies_and_rebuilds_bit_exactly(bucket: str, run: Any) -> None:
    name = "/".join(bucket.rsplit("/", 2)[1:])

    async def go() -> tuple[list[str], dict[int, dict[str, str]]]:
        async with BucketReader.open(bucket) as reader:
            problems = await reader.verify()
            rebuilt = {}
            for step in await reader.list_steps():
                rebuilt[step] = {k: _digest(v) for k, v in (await reader.read_full(step)).items()}
            return problems, rebuilt

    problems, rebuilt = run(go())
    assert problems == []
    assert {str(s): d for s, d in rebuilt.items()} == EXPECTED[name]


@pytest.mark.parametrize("bucket", BUCKETS, indirect=True)
def test_old_bucket_through_cli_verify_and_materialize(bucket: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    name = "/".join(bucket.rsplit("/", 2)[1:])
    assert _run_verify(argparse.Namespace(url=bucket)) == 0
    assert "ok: 5 steps verified" in capsys.readouterr().out
    for step in (2, 4):
        out = tmp_path / f"out{step}"
        args = argparse.Namespace(url=bucket, step=step, out=str(out), force=False)
        assert _run_materialize(args) == 0
        tensors = load_file(str(out / "model.safetensors"))
        assert {k: _digest(v) for k, v in tensors.items()} == EXPECTED[name][str(step)]

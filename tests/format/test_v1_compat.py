"""Format v1 buckets written by the v1 publisher (tests/data/v1, committed) stay readable forever.

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

DATA = Path(__file__).resolve().parents[1] / "data" / "v1"
EXPECTED: dict[str, dict[str, dict[str, str]]] = json.loads((DATA / "expected.json").read_text())
CODECS = sorted(EXPECTED)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.int16).numpy().tobytes()).hexdigest()


@pytest.fixture
def bucket(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A private copy (tests must never alter the committed data)."""
    codec = request.param
    shutil.copytree(DATA / codec, tmp_path / codec)
    return f"file://{tmp_path / codec}"


def test_every_codec_and_step_is_present() -> None:
    assert CODECS == ["sparse-v1", "sparse-v2", "sparse-v2-zstd"]
    for codec in CODECS:
        manifests = json.loads((DATA / codec / "manifests" / "000000000004.json").read_text())
        assert manifests["schema_version"] == 1
        assert {t["encoding"] for t in manifests["tensors"]} == {codec}
        assert sorted(EXPECTED[codec]) == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize("bucket", CODECS, indirect=True)
def test_v1_bucket_verifies_and_rebuilds_bit_exactly(bucket: str, run: Any) -> None:
    codec = bucket.rsplit("/", 1)[1]

    async def go() -> tuple[list[str], dict[int, dict[str, str]]]:
        async with BucketReader.open(bucket) as reader:
            problems = await reader.verify()
            rebuilt = {}
            for step in await reader.list_steps():
                rebuilt[step] = {k: _digest(v) for k, v in (await reader.read_full(step)).items()}
            return problems, rebuilt

    problems, rebuilt = run(go())
    assert problems == []
    assert {str(s): d for s, d in rebuilt.items()} == EXPECTED[codec]


@pytest.mark.parametrize("bucket", CODECS, indirect=True)
def test_v1_bucket_through_cli_verify_and_materialize(bucket: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    codec = bucket.rsplit("/", 1)[1]
    assert _run_verify(argparse.Namespace(url=bucket)) == 0
    assert "ok: 5 steps verified" in capsys.readouterr().out
    for step in (2, 4):
        out = tmp_path / f"out{step}"
        args = argparse.Namespace(url=bucket, step=step, out=str(out), force=False)
        assert _run_materialize(args) == 0
        tensors = load_file(str(out / "model.safetensors"))
        assert {k: _digest(v) for k, v in tensors.items()} == EXPECTED[codec][str(step)]

"""Damaged buckets: reported by `verify`, refused by the reader and by `materialize`."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers.publishing import Trainer, bits_equal, publish_run, read_full, run_cli
from vllm_deltasync import BucketReader
from vllm_deltasync.cli import main
from vllm_deltasync.errors import ChainError, FormatError, IntegrityError


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "bucket"
    publish_run(f"file://{root}", range(8), Trainer(lr=3e-5), anchor_every=4, max_file_bytes=8192)
    return root


def data_file(root: Path, step: int, index: int = 0) -> Path:
    (folder,) = (root / "data").glob(f"{step:012d}-*")
    return folder / f"{index:05d}.safetensors"


def corrupt(root: Path) -> None:
    path = data_file(root, 6)
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0x01
    path.write_bytes(bytes(blob))


def truncate(root: Path) -> None:
    path = data_file(root, 4, 1)
    path.write_bytes(path.read_bytes()[:-10])


def remove_file(root: Path) -> None:
    data_file(root, 5).unlink()


def remove_link(root: Path) -> None:
    (root / "manifests" / f"{5:012d}.json").unlink()


def bad_schema(root: Path) -> None:
    path = root / "manifests" / f"{6:012d}.json"
    doc = json.loads(path.read_text())
    doc["schema_version"] = 99
    path.write_text(json.dumps(doc))


CASES: dict[str, tuple[Callable[[Path], None], type[Exception], list[str]]] = {
    "corrupt": (corrupt, IntegrityError, [f"step 6: data file data/{6:012d}-", "sha256"]),
    "truncated": (truncate, IntegrityError, ["step 4: data file", "00001.safetensors is", "bytes"]),
    "missing-file": (remove_file, IntegrityError, ["step 5: data file", "is missing"]),
    "missing-link": (remove_link, ChainError, ["step 6: base step 5 is missing",
                                                "step 7: cannot be rebuilt, its chain misses step 5"]),
    "bad-schema": (bad_schema, FormatError, [f"manifests/{6:012d}.json: schema_version 99"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damage_is_reported_and_refused(
    case: str, pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damage, error, lines = CASES[case]
    root = tmp_path / "bucket"
    shutil.copytree(pristine, root)
    damage(root)
    url = f"file://{root}"

    verify = run_cli("verify", url)
    assert verify.returncode == 1, verify.stdout
    for needle in lines:
        assert needle in verify.stdout, (needle, verify.stdout)
    problems = verify.stdout.strip().splitlines()
    assert 1 <= len(problems) <= 2

    async def rebuild() -> None:
        async with BucketReader.open(url) as reader:
            await reader.read_full(7)

    with pytest.raises(error):
        asyncio.run(rebuild())

    out = tmp_path / "out"
    argv = ["materialize", url, "--step", "7", "--out", str(out)]
    if case == "corrupt":  # the console script; the others in-process (faster)
        materialize = run_cli(*argv)
        status, stderr = materialize.returncode, materialize.stderr
    else:
        status, stderr = main(argv), capsys.readouterr().err
    assert status == 1
    assert stderr.startswith("vllm-deltasync materialize: "), stderr
    assert not out.exists()


def test_iter_patches_yields_nothing_from_a_bad_file(pristine: Path, tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    shutil.copytree(pristine, root)
    corrupt(root)

    async def go() -> list[str]:
        seen: list[str] = []
        async with BucketReader.open(f"file://{root}", max_concurrency=1) as reader:
            m = await reader.manifest(6)
            bad = {e.name for e in m.tensors if any(c.file == 0 for c in e.chunks)}
            with pytest.raises(IntegrityError):
                async for patch in reader.iter_patches(m, select=lambda n: n in bad):
                    seen.append(patch.name)
        return seen

    assert asyncio.run(go()) == []


def test_pristine_bucket_verifies_and_materializes(
    pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{pristine}"
    assert main(["verify", url]) == 0
    assert capsys.readouterr().out.startswith("ok: 8 steps verified")
    out = tmp_path / "ckpt"
    done = run_cli("materialize", url, "--step", "6", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert bits_equal(load_file(out / "model.safetensors"), read_full(url, 6))
    assert main(["materialize", url, "--step", "6", "--out", str(out)]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["materialize", url, "--out", str(out), "--force"]) == 0
    assert bits_equal(load_file(out / "model.safetensors"), read_full(url, 7))

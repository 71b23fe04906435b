"""Manifest format v3: version 2 with the tensor table deflated; round trip, size, and refusals
of hostile tables (bombs, bad base64, truncated streams) before anything is sized by them."""

from __future__ import annotations

import base64
import dataclasses
import json
import zlib
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.publishing import Trainer, bits_equal, publish_run
from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.manifest import (
    MAX_MANIFEST_BYTES,
    TABLE_KEY,
    Manifest,
    dump_document,
    load_document,
)
from vllm_deltasync.format.reader import BucketReader


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    root = tmp_path_factory.mktemp("v3") / "bucket"
    truth = publish_run(f"file://{root}", range(4), Trainer(seed=5, lr=3e-6), anchor_every=10,
                        max_file_bytes=4096, codec="sparse-v3")
    return root, truth


def _raw(root: Path, step: int) -> bytes:
    return (root / "manifests" / f"{step:012d}.json").read_bytes()


def test_publisher_writes_v3_and_the_reader_rebuilds_every_step(bucket: tuple[Path, dict[int, Any]],
                                                                run: Any) -> None:
    root, truth = bucket
    raw = json.loads(_raw(root, 2))
    assert raw["schema_version"] == 3 and raw["requires"] == "vllm-deltasync>=0.4.0"
    assert "tensors" not in raw and isinstance(raw[TABLE_KEY], str)
    assert all("index" not in f for f in raw["files"])  # rebuilt by the reader

    async def go() -> tuple[list[str], dict[int, dict[str, Any]]]:
        async with BucketReader.open(f"file://{root}") as reader:
            return await reader.verify(), {s: await reader.read_full(s) for s in range(4)}

    problems, rebuilt = run(go())
    assert problems == []
    assert all(bits_equal(rebuilt[step], weights) for step, weights in truth.items())


def test_v3_is_the_v2_document_deflated(bucket: tuple[Path, dict[int, Any]]) -> None:
    root, _ = bucket
    for step in (0, 2):
        m = Manifest.from_json(_raw(root, step), source="m")
        v2 = dataclasses.replace(m, schema_version=2, requires=None)
        expanded = load_document(_raw(root, step))
        doc2 = json.loads(v2.to_json())
        assert {k: v for k, v in expanded.items() if k not in ("schema_version", "requires")} == \
               {k: v for k, v in doc2.items() if k not in ("schema_version", "requires")}
        assert Manifest.from_json(v2.to_json(), source="m2").tensors == m.tensors
        assert dump_document(expanded) == _raw(root, step)  # load/dump are inverse
        assert len(_raw(root, step)) < 0.7 * len(v2.to_json()), (len(_raw(root, step)), len(v2.to_json()))


def _with_table(root: Path, table: str) -> bytes:
    doc = json.loads(_raw(root, 2))
    doc[TABLE_KEY] = table
    return json.dumps(doc).encode()


@pytest.mark.parametrize(("table", "needle"), [
    (base64.b64encode(zlib.compress(b"[" + b" " * (MAX_MANIFEST_BYTES + 10) + b"]", 9)).decode(),
     "inflates to more than"),
    ("not base64!", "not valid base64"),
    (base64.b64encode(b"plain bytes, not zlib").decode(), "not a zlib stream"),
    (base64.b64encode(zlib.compress(b"[]" * 50)[:-6]).decode(), "truncated"),
    (base64.b64encode(zlib.compress(b"[]") + b"junk").decode(), "junk"),
    (base64.b64encode(zlib.compress(b'{"tensors": 1}')).decode(), "not a list"),
    (base64.b64encode(zlib.compress(b"\xff\xfe[]")).decode(), "not UTF-8"),
    (base64.b64encode(zlib.compress(b"[NaN]")).decode(), "NaN"),
])
def test_hostile_tables_are_refused_in_one_line(bucket: tuple[Path, dict[int, Any]], table: str,
                                                needle: str) -> None:
    root, _ = bucket
    with pytest.raises(FormatError, match=needle) as err:
        Manifest.from_json(_with_table(root, table), source="manifests/000000000002.json")
    assert "manifests/000000000002.json" in str(err.value) and "\n" not in str(err.value)


def test_a_v3_document_without_its_table_or_with_a_file_index_is_refused(
        bucket: tuple[Path, dict[int, Any]]) -> None:
    root, _ = bucket
    expanded = load_document(_raw(root, 2))
    plain = json.dumps(expanded).encode()  # v3 in the v2 shape: not what version 3 is
    with pytest.raises(FormatError, match=TABLE_KEY):
        Manifest.from_json(plain, source="m")
    doc = json.loads(_raw(root, 2))
    doc["files"][0]["index"] = {}
    with pytest.raises(FormatError, match="no file index"):
        Manifest.from_json(json.dumps(doc).encode(), source="m")


def test_a_tampered_table_is_caught_by_the_v2_checks(bucket: tuple[Path, dict[int, Any]]) -> None:
    root, _ = bucket
    doc = load_document(_raw(root, 2))
    doc["tensors"][0]["chunks"][0]["roles"]["data"]["offset"] = 10**9  # past its file
    with pytest.raises(FormatError, match="outside"):
        Manifest.from_json(dump_document(doc), source="m")

"""Fault matrix, bucket contents: coverage (item 1), memory bounds (item 6), manifest strictness
and ``verify`` decoding (item 8). A hostile or buggy publisher wrote the bucket; every path
(reader, ``verify``, ``materialize``, the poller) refuses the step and nothing of it is staged.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.faults import (
    cli,
    manifest_doc,
    one_line_error,
    reindex,
    rewrite_role,
    root_of,
    sparse_chunk,
    write_doc,
)
from tests.helpers.publishing import Trainer, bits_equal, publish_run, read_full
from vllm_deltasync.cli.bucket import _run_verify
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.manifest import Manifest, dump_document, fingerprint
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.server.worker.poller import Poller

V1_DATA = Path(__file__).resolve().parents[1] / "data" / "v1"


def _fingerprint() -> str:
    weights = Trainer(seed=11).weights
    return fingerprint((n, tuple(w.shape), "bfloat16") for n, w in weights.items())


def poller_refuses(url: str, bad: int) -> Any:
    """The server's poller never stages ``bad`` nor anything after it; returns its status."""
    poller = Poller(SyncConfig(url=url, poll_interval_s=0.05), lambda m, p: (p, 1),
                    fingerprint=_fingerprint())
    poller.start()
    try:
        deadline = time.monotonic() + 10
        while poller.status().last_error is None:
            assert time.monotonic() < deadline, "the poller never reported the bad step"
            time.sleep(0.02)
        time.sleep(0.3)  # rounds in which it could (wrongly) move on
        assert all(s < bad for s in poller.ready_steps())
        status = poller.status()
        assert f"step {bad}" in str(status.last_error)
        failures = status.counters.failures
        assert failures and all(r.isidentifier() for _, r, _ in failures)  # bounded labels
        return status
    finally:
        poller.close()


def verify_problems(url: str) -> list[str]:
    async def go() -> list[str]:
        async with BucketReader.open(url) as reader:
            return await reader.verify()

    return asyncio.run(go())


def _refused_everywhere(url: str, step: int, truth: dict[int, Any], match: str = "") -> None:
    with pytest.raises(FormatError, match=match or f"step {step}"):
        read_full(url, 3)
    if step > 0:
        assert bits_equal(read_full(url, step - 1), truth[step - 1])
    assert any(f"step {step}" in p or f"{step:012d}" in p for p in verify_problems(url))
    assert _run_verify(argparse.Namespace(url=url)) == 1
    poller_refuses(url, step)


def _biggest(doc: dict[str, Any]) -> dict[str, Any]:
    return max(doc["tensors"], key=lambda t: len(t["chunks"]))


# ---------------------------------------------------------------- item 1: coverage
def test_anchor_leaving_a_tensor_out_is_refused(small_bucket: tuple[str, Any]) -> None:
    url, truth = small_bucket
    doc = manifest_doc(root_of(url), 0)
    doc["tensors"].remove(_biggest(doc))
    reindex(doc)
    write_doc(root_of(url), 0, doc)
    _refused_everywhere(url, 0, truth)


def test_anchor_covering_a_tensor_in_part_is_refused(small_bucket: tuple[str, Any]) -> None:
    url, truth = small_bucket
    doc = manifest_doc(root_of(url), 0)
    _biggest(doc)["chunks"].pop()
    reindex(doc)
    write_doc(root_of(url), 0, doc)
    _refused_everywhere(url, 0, truth)


def test_v2_delta_listing_a_chunk_twice_is_refused(small_bucket: tuple[str, Any]) -> None:
    url, truth = small_bucket
    doc = manifest_doc(root_of(url), 2)
    t = _biggest(doc)
    t["chunks"].append(copy.deepcopy(t["chunks"][0]))
    t["changed"] += t["chunks"][0]["count"]
    doc["totals"]["changed"] += t["chunks"][0]["count"]
    reindex(doc)
    write_doc(root_of(url), 2, doc)
    _refused_everywhere(url, 2, truth)


def test_v1_sparse_v2_delta_listing_a_chunk_twice_fails_verify(tmp_path: Path) -> None:
    root = tmp_path / "b"
    shutil.copytree(V1_DATA / "sparse-v2", root)
    doc = manifest_doc(root, 1)
    t = max(doc["tensors"], key=lambda t: len(t["chunks"]))
    dup = copy.deepcopy(t["chunks"][0])
    shift = t["changed"]
    dup["start"], dup["stop"] = dup["start"] + shift, dup["stop"] + shift  # tiles the list
    t["chunks"].append(dup)
    t["changed"] += dup["stop"] - dup["start"]
    doc["totals"]["changed"] += dup["stop"] - dup["start"]
    write_doc(root, 1, doc)
    url = f"file://{root}"
    assert any("step 1" in p for p in verify_problems(url))
    assert _run_verify(argparse.Namespace(url=url)) == 1


def test_two_writers_chunks_overlapping_in_one_step_are_refused(small_bucket: tuple[str, Any]) -> None:
    url, truth = small_bucket
    doc = manifest_doc(root_of(url), 2)
    t = _biggest(doc)
    rogue = copy.deepcopy(t["chunks"][0])
    off, length = rogue["region"]
    rogue["region"] = [off + 1, length]
    t["chunks"].append(rogue)
    t["changed"] += rogue["count"]
    doc["totals"]["changed"] += rogue["count"]
    reindex(doc)
    write_doc(root_of(url), 2, doc)
    _refused_everywhere(url, 2, truth)


# ---------------------------------------------------------------- item 6: memory
@pytest.fixture
def zstd_bucket(tmp_path: Path) -> tuple[str, dict[int, Any]]:
    url = f"file://{tmp_path}/zb"
    truth = publish_run(url, range(3), Trainer(seed=11, lr=3e-6), anchor_every=10,
                        max_file_bytes=1 << 20, codec="sparse-v2-zstd")
    return url, truth


def _frame_claiming(content_size: int, payload: bytes) -> bytes:
    """A valid zstd frame header that says ``content_size`` bytes, then one raw block."""
    header = struct.pack("<IBB", 0xFD2FB528, 0xC0, 0x00) + struct.pack("<Q", content_size)
    block = struct.pack("<I", 1 | (len(payload) << 3))[:3]
    return header + block + payload


def test_zstd_frame_claiming_a_terabyte_is_refused_before_allocating(zstd_bucket: tuple[str, Any]) -> None:
    url, truth = zstd_bucket
    root = root_of(url)
    doc = manifest_doc(root, 1)
    t, c = sparse_chunk(doc)
    rewrite_role(root, doc, t, c, "data", _frame_claiming(1 << 40, b"\0" * 64))
    write_doc(root, 1, doc)
    started = time.monotonic()
    with pytest.raises(FormatError, match="refused before decompressing"):
        read_full(url, 2)
    assert time.monotonic() - started < 10
    assert bits_equal(read_full(url, 0), truth[0])
    poller_refuses(url, 1)


def test_zstd_raw_size_beyond_what_the_chunk_may_hold_is_refused(zstd_bucket: tuple[str, Any]) -> None:
    url, _ = zstd_bucket
    root = root_of(url)
    doc = manifest_doc(root, 1)
    _, c = sparse_chunk(doc)
    c["meta"]["raw_bytes"] = 1 << 30  # a 1 GiB claim for a chunk of a few hundred elements
    write_doc(root, 1, doc)
    with pytest.raises(FormatError, match="raw_bytes"):
        read_full(url, 2)


def test_shape_of_1e15_elements_is_refused_by_the_parser(small_bucket: tuple[str, Any],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = small_bucket
    doc = manifest_doc(root_of(url), 2)
    doc["tensors"][0]["shape"] = [10**15]
    write_doc(root_of(url), 2, doc)
    with pytest.raises(FormatError, match="claims 1000000000000000 elements"):
        Manifest.from_json(dump_document(doc), source="x")
    rc, _, err = cli(capsys, "materialize", url, "--step", "2", "--out", str(root_of(url).parent / "o"))
    one_line_error(rc, err)


def test_region_rows_beyond_the_tensor_are_refused(small_bucket: tuple[str, Any]) -> None:
    url, _ = small_bucket
    doc = manifest_doc(root_of(url), 2)
    t, c = sparse_chunk(doc)
    rogue = copy.deepcopy(c)
    rogue["count"], rogue["region"] = 0, [0, 10**12, 0, 0]  # 10^12 empty rows, no elements:
    t["chunks"].append(rogue)                               # a memory bomb for the coverage check
    reindex(doc)
    write_doc(root_of(url), 2, doc)
    with pytest.raises(FormatError, match="region"):
        read_full(url, 3)


# ---------------------------------------------------------------- item 8: the parser
def _doc_bytes(url: str, step: int, mutate: Any) -> bytes:
    doc = manifest_doc(root_of(url), step)
    out = mutate(doc)
    return out if isinstance(out, bytes) else dump_document(doc)


PARSER_CASES = {
    "shape-as-string": (lambda d: d["tensors"][0].__setitem__("shape", "6448"), "shape"),
    "float-dimension": (lambda d: d["tensors"][0].__setitem__("shape", [32.0, 32]), "shape"),
    "nan-created-at": (lambda d: json.dumps(d).replace(
        f'"created_at": {json.dumps(d["created_at"])}', '"created_at": NaN').encode(), "NaN"),
    "utf16-json": (lambda d: json.dumps(d).encode("utf-16"), "not UTF-8"),
    "nul-in-path": (lambda d: d["files"][0].__setitem__("path", d["files"][0]["path"] + "\x00x"),
                    "file path"),
    "deeply-nested": (lambda d: b"[" * 100000 + b"]" * 100000, "nested|not a JSON object"),
    "huge-integer": (lambda d: d["files"][0].__setitem__("size", 10**30), "size"),
}


@pytest.mark.parametrize("case", sorted(PARSER_CASES))
def test_manifest_parser_is_strict(small_bucket: tuple[str, Any], case: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = small_bucket
    mutate, match = PARSER_CASES[case]
    data = _doc_bytes(url, 2, mutate)
    with pytest.raises(FormatError, match=match):
        Manifest.from_json(data, source="m")
    write_doc(root_of(url), 2, data)
    rc, out, err = cli(capsys, "verify", url)
    assert rc == 1 and "Traceback" not in out + err
    assert any("000000000002" in line or "step 2" in line for line in out.splitlines())


def test_out_of_range_codec_metadata_is_one_problem_line(small_bucket: tuple[str, Any],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = small_bucket
    doc = manifest_doc(root_of(url), 2)
    _, c = sparse_chunk(doc)
    c["meta"]["first"] = 10**30
    write_doc(root_of(url), 2, doc)
    with pytest.raises(FormatError, match="first"):
        read_full(url, 3)
    rc, out, err = cli(capsys, "verify", url)
    assert rc == 1 and "Traceback" not in out + err and "first" in out


def test_verify_decodes_and_reports_undecodable_chunks(small_bucket: tuple[str, Any],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Digests all match; only decoding shows the chunk is garbage (values mode unknown)."""
    url, _ = small_bucket
    doc = manifest_doc(root_of(url), 1)
    _, c = sparse_chunk(doc)
    c["meta"]["values"] = "diff9"
    write_doc(root_of(url), 1, doc)
    rc, out, _ = cli(capsys, "verify", url)
    assert rc == 1 and "diff9" in out


def test_verify_reports_an_unknown_encoding(small_bucket: tuple[str, Any],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = small_bucket
    doc = manifest_doc(root_of(url), 1)
    for t in doc["tensors"]:
        t["encoding"] = "sparse-v9"
    write_doc(root_of(url), 1, doc)
    rc, out, _ = cli(capsys, "verify", url)
    assert rc == 1 and "sparse-v9" in out

"""Format v2: round trips, ranged verified reads, and the coverage rule on every read path.

The coverage rule (docs/format.md): an anchor covers every element of every fingerprinted
parameter exactly once; a delta touches each element at most once. Hostile manifests are
made by editing a real bucket, then fed to the reader (``read_full``), ``verify``,
``materialize`` and the server's poller; none of them may apply or stage the step.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.publishing import Trainer, bits_equal, publish_run, read_full, reindex
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.cli.bucket import _run_materialize, _run_verify
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import FormatError, IntegrityError
from vllm_deltasync.format.manifest import (
    SCHEMA_VERSION,
    Manifest,
    dump_document,
    fingerprint,
    load_document,
    manifest_identity,
)
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.server.worker.poller import Poller

CODECS = ("sparse-v1", "sparse-v2", "sparse-v2-zstd")
SHAPES = {"a.weight": (64, 48), "b.weight": (48,), "c.weight": (40, 32), "d.weight": (16, 16)}


def _manifest_doc(root: Path, step: int) -> dict[str, Any]:
    return load_document((root / "manifests" / f"{step:012d}.json").read_bytes())  # type: ignore[no-any-return]


def _write_doc(root: Path, step: int, doc: dict[str, Any]) -> None:
    (root / "manifests" / f"{step:012d}.json").write_bytes(dump_document(doc))


@pytest.mark.parametrize("codec", CODECS)
def test_v2_round_trip_every_codec_bit_exact(bucket: str, codec: str, tmp_path: Path) -> None:
    trainer = Trainer(seed=3, lr=3e-6)
    truth = publish_run(bucket, range(7), trainer, anchor_every=3, max_file_bytes=2048, codec=codec,
                        keep_anchors=5)
    root = Path(bucket[len("file://"):])
    for step, kind in ((0, "anchor"), (1, "delta"), (3, "anchor"), (6, "anchor")):
        doc = _manifest_doc(root, step)
        assert doc["schema_version"] == SCHEMA_VERSION and doc["kind"] == kind
        assert {t["encoding"] for t in doc["tensors"]} == {"dense" if kind == "anchor" else codec}
        assert all(t["codec_version"] == 1 for t in doc["tensors"])
        assert len(doc["files"]) > 1 or kind == "delta"  # anchors span files
    for step in range(7):
        assert bits_equal(read_full(bucket, step), truth[step]), step
    assert _run_verify(argparse.Namespace(url=bucket)) == 0
    out = tmp_path / "out"
    assert _run_materialize(argparse.Namespace(url=bucket, step=5, out=str(out), force=False)) == 0
    from safetensors.torch import load_file
    assert bits_equal(load_file(str(out / "model.safetensors")), truth[5])


def test_column_shards_from_two_writers_with_strided_regions(bucket: str, run: Any) -> None:
    """Two writers' chunks (column shards, in any order) cover an anchor exactly once."""
    trainer = Trainer(seed=5, shapes={"w": (8, 6)})
    truth = publish_run(bucket, [0], trainer, anchor_every=10)
    root = Path(bucket[len("file://"):])
    doc = _manifest_doc(root, 0)
    tensor = doc["tensors"][0]
    (chunk,) = tensor["chunks"]
    # rewrite the file's single dense chunk as two column shards: columns 3-5 first, then 0-2
    data = bytearray((root / doc["files"][0]["path"]).read_bytes())
    role = chunk["roles"]["values"]
    values = torch.frombuffer(bytearray(data[role["offset"]:role["offset"] + role["length"]]),
                              dtype=torch.bfloat16).view(8, 6)
    right, left = values[:, 3:].contiguous(), values[:, :3].contiguous()
    payload = right.view(torch.uint8).reshape(-1).tolist() + left.view(torch.uint8).reshape(-1).tolist()
    data[role["offset"]:role["offset"] + role["length"]] = bytes(payload)
    (root / doc["files"][0]["path"]).write_bytes(bytes(data))
    import hashlib
    doc["files"][0]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    shards = []
    for i, (col, part) in enumerate(((3, right), (0, left))):
        c = copy.deepcopy(chunk)
        c["count"], c["region"] = 24, [col, 8, 3, 6]
        c["roles"]["values"].update(offset=role["offset"] + 48 * i, length=48)
        c["sha256"] = hashlib.sha256(part.view(torch.uint8).numpy().tobytes()).hexdigest()
        shards.append(c)
    tensor["chunks"] = shards
    _write_doc(root, 0, doc)
    assert bits_equal(read_full(bucket, 0), truth[0])
    # a third chunk that overlaps one element of the first writer's shard is refused
    extra = copy.deepcopy(shards[1])
    extra["region"] = [2, 8, 3, 6]
    tensor["chunks"] = [*shards, extra]
    _write_doc(root, 0, doc)
    with pytest.raises(FormatError, match="two chunks cover element 2"):
        read_full(bucket, 0)


def test_ranged_read_of_one_tensor_over_hf(make_hf_store: Callable[..., Any], hub: Any, run: Any) -> None:
    """One tensor out of a multi-tensor file: only its bytes cross the wire, verified by digest."""
    store = make_hf_store()
    options = {"endpoint": hub.endpoint, "token": hub.token, "environ": {},
               "uploader": store._uploader, "part_size": 1 << 16}
    trainer = Trainer(seed=9, shapes=SHAPES)
    with DeltaPublisher(store.url, anchor_every=10, store_options=options) as pub:
        trainer.step()
        pub.publish(0, trainer.weights)
    truth = trainer.bf16()["c.weight"].view(-1)

    async def go() -> tuple[Manifest, list[Any], int]:
        async with BucketReader.open(store.url, store_options=options) as reader:
            m = await reader.manifest(0)
            hub.log.clear()
            hub.cdn_bytes_served = 0
            patches = [p async for p in reader.iter_patches(m, select=lambda n: n == "c.weight")]
            return m, patches, sum(r.get("bytes", 0) for r in hub.requests("cdn"))

    m, patches, fetched = run(go())
    assert len(m.files) == 1 and len(m.tensors) == 4  # every tensor shares the one file
    (entry,) = [t for t in m.tensors if t.name == "c.weight"]
    expected = sum(r.length for c in entry.chunks for r in (c.roles or {}).values())
    assert m.files[0].index is not None and m.files[0].index["c.weight"] == ((m.files[0].index["c.weight"][0]),)
    assert fetched == expected == 40 * 32 * 2 < m.files[0].size // 2
    assert all(r["range"] for r in hub.requests("cdn"))
    flat = torch.empty(40 * 32, dtype=torch.bfloat16)
    for p in patches:
        p.apply_to(flat)
    assert torch.equal(flat.view(torch.int16), truth.view(torch.int16))

    # the same bytes, altered in the bucket: the chunk digest refuses them before decoding
    path = m.files[0].path
    bucket_id = store.url.split("hf://buckets/")[1].rsplit("/", 1)[0]
    prefix = store.url.rsplit("/", 1)[1]
    data = bytearray(hub.buckets[bucket_id][f"{prefix}/{path}"])
    (role,) = entry.chunks[0].roles.values()  # type: ignore[union-attr]
    data[role.offset + 5] ^= 1
    hub.buckets[bucket_id][f"{prefix}/{path}"] = bytes(data)

    async def again() -> None:
        async with BucketReader.open(store.url, store_options=options) as reader:
            m = await reader.manifest(0)
            async for _ in reader.iter_patches(m, select=lambda n: n == "c.weight"):
                pass

    with pytest.raises(IntegrityError, match="'c.weight': a chunk .* has sha256"):
        run(again())


# ---------------------------------------------------------------------------- coverage
def _multi_chunk(doc: dict[str, Any]) -> dict[str, Any]:
    return max(doc["tensors"], key=lambda t: len(t["chunks"]))


def missing(doc: dict[str, Any]) -> None:
    doc["tensors"].remove(_multi_chunk(doc))


def partly(doc: dict[str, Any]) -> None:
    _multi_chunk(doc)["chunks"].pop()


def twice(doc: dict[str, Any]) -> None:
    t = _multi_chunk(doc)
    t["chunks"].append(copy.deepcopy(t["chunks"][0]))


def two_writers(doc: dict[str, Any]) -> None:
    """A second writer's chunk whose region overlaps the first writer's by one element."""
    t = _multi_chunk(doc)
    rogue = copy.deepcopy(t["chunks"][0])
    off, length = rogue["region"]
    numel = 1
    for d in t["shape"]:
        numel *= d
    rogue["region"] = [off + 1 if off + length < numel else off - 1, length]
    t["chunks"].append(rogue)
    if doc["kind"] == "delta":  # the counts add up: only the overlap is wrong
        t["changed"] += rogue["count"]
        doc["totals"]["changed"] += rogue["count"]


MUTATIONS = {"missing": missing, "partly": partly, "twice": twice, "two-writers": two_writers}


@pytest.fixture
def chain(tmp_path: Path) -> tuple[str, dict[int, dict[str, torch.Tensor]]]:
    url = f"file://{tmp_path}/bucket"
    truth = publish_run(url, range(4), Trainer(seed=11, lr=3e-6), anchor_every=10,
                        max_file_bytes=2048, codec="sparse-v2")
    return url, truth


def _poller_never_stages(url: str, bad: int) -> None:
    fp = fingerprint((n, s, "bfloat16") for n, s in Trainer(seed=11).weights.items()
                     for s in [tuple(Trainer(seed=11).weights[n].shape)])
    poller = Poller(SyncConfig(url=url, poll_interval_s=0.05), lambda m, p: (p, 1), fingerprint=fp)
    poller.start()
    try:
        deadline = time.monotonic() + 10
        while poller.status().last_error is None:
            assert time.monotonic() < deadline, "the poller never reported the bad step"
            time.sleep(0.02)
        time.sleep(0.3)  # give it rounds to (wrongly) move on
        assert bad not in poller.ready_steps()
        assert all(s < bad for s in poller.ready_steps())
        assert "step" in str(poller.status().last_error)
    finally:
        poller.close()


@pytest.mark.parametrize("kind_step", [0, 2], ids=["anchor", "delta"])
@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_coverage_is_enforced_on_every_path(chain: tuple[str, Any], case: str, kind_step: int,
                                            tmp_path: Path) -> None:
    url, truth = chain
    root = Path(url[len("file://"):])
    doc = _manifest_doc(root, kind_step)
    MUTATIONS[case](doc)
    reindex(doc)
    _write_doc(root, kind_step, doc)
    # reader
    with pytest.raises(FormatError, match=f"step {kind_step}"):
        read_full(url, 3)
    if kind_step == 2:
        assert bits_equal(read_full(url, 1), truth[1])  # the steps before it still read
    # verify
    async def problems() -> list[str]:
        async with BucketReader.open(url) as reader:
            return await reader.verify()
    found = asyncio.run(problems())
    assert any(f"step {kind_step}" in p for p in found), found
    assert _run_verify(argparse.Namespace(url=url)) == 1
    # materialize
    with pytest.raises(FormatError):
        _run_materialize(argparse.Namespace(url=url, step=3, out=str(tmp_path / "o"), force=False))
    assert not (tmp_path / "o" / "model.safetensors").exists()
    # the server's poller
    _poller_never_stages(url, kind_step)


@pytest.mark.parametrize("case", ["missing", "partly", "twice"])
def test_coverage_is_enforced_on_v1_buckets(case: str, tmp_path: Path) -> None:
    import shutil
    src = Path(__file__).resolve().parents[1] / "data" / "v1" / "sparse-v2"
    shutil.copytree(src, tmp_path / "b")
    root = tmp_path / "b"
    for step in (0, 1):
        fresh = tmp_path / f"c{step}"
        shutil.copytree(src, fresh)
        doc = _manifest_doc(fresh, step)
        MUTATIONS[case](doc)
        _write_doc(fresh, step, doc)
        with pytest.raises(FormatError, match=f"step {step}"):
            read_full(f"file://{fresh}", 2)
        assert _run_verify(argparse.Namespace(url=f"file://{fresh}")) == 1
    assert _run_verify(argparse.Namespace(url=f"file://{root}")) == 0


def test_delta_chains_never_cross_runs(chain: tuple[str, Any]) -> None:
    url, _ = chain
    root = Path(url[len("file://"):])
    doc = _manifest_doc(root, 2)
    doc["run_id"] = "feedfacefeedface"
    _write_doc(root, 2, doc)
    # the rewritten step 2 is another identity: step 3, computed from the original, refuses it
    with pytest.raises(FormatError, match="chain was rewritten"):
        read_full(url, 3)
    # a delta that names the rewritten step 2 as its base still never crosses runs
    delta = _manifest_doc(root, 3)
    delta["base_id"] = manifest_identity((root / "manifests" / f"{2:012d}.json").read_bytes())
    _write_doc(root, 3, delta)
    with pytest.raises(FormatError, match="never crosses runs"):
        read_full(url, 3)

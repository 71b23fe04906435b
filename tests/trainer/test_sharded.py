"""Sharded trainers: every rank publishes its own shards, one rank commits (docs/trainer.md).

The multi-rank tests run ``tests/helpers/dist_worker.py`` under ``torchrun`` (gloo, CPU) in a
subprocess with a timeout; the worker saves the full model gathered in the test only, and here
every committed step is materialized from the bucket and compared bit for bit.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.torchrun import torchrun
from vllm_deltasync.format.manifest import Manifest, Region, fingerprint
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.trainer.sharded import blocks, merge_parts


def _read(url: str) -> tuple[dict[int, Manifest], dict[int, dict[str, torch.Tensor]], list[str]]:
    async def go() -> tuple[dict[int, Manifest], dict[int, dict[str, torch.Tensor]], list[str]]:
        async with BucketReader.open(url) as reader:
            steps = await reader.list_steps()
            manifests = {s: await reader.manifest(s) for s in steps}
            full = {s: await reader.read_full(s) for s in steps}
            return manifests, full, await reader.verify()
    return asyncio.run(go())


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def _check_every_step(url: str, out: Path) -> dict[int, Manifest]:
    manifests, full, problems = _read(url)
    assert problems == []
    for step, weights in full.items():
        assert _bits_equal(weights, load_file(str(out / f"truth-{step}.safetensors"))), step
    return manifests


def _folders_of(m: Manifest, name: str) -> set[str]:
    entry = m.tensor(name)
    assert entry is not None
    return {m.files[c.file].path.rsplit("/", 1)[0] for c in entry.chunks}


# ---------------------------------------------------------------------------- one process
@pytest.mark.parametrize("shape", [(7,), (9, 5), (6, 7), (3, 4, 5), (2, 3, 4, 5)])
def test_blocks_cover_the_box_in_its_order(shape: tuple[int, ...]) -> None:
    """Every box (any cut on any dims) maps, in the box's flat order, to its full-tensor elements."""
    full = torch.arange(math.prod(shape)).view(shape)
    cuts = [sorted({0, d // 3, d // 2, d}) for d in shape]
    for bounds in itertools.product(*[list(itertools.combinations(c, 2)) for c in cuts]):
        offset = [a for a, _ in bounds]
        local = [b - a for a, b in bounds]
        box = full[tuple(slice(a, b) for a, b in bounds)].reshape(-1)
        flat = []
        for r in blocks(shape, local, offset):
            flat.extend(r.offset + i * r.row_stride + j for i in range(r.rows) for j in range(r.row_len))
        assert flat == box.tolist(), (shape, bounds)


def test_shards_split_in_small_chunks_read_back_bit_exact(tmp_path: Path) -> None:
    """Column and row shards, written by 'ranks' in chunks of a few rows or parts of one row,
    merged into one manifest: the coverage rule holds and every element reads back."""
    from vllm_deltasync._loop import default_loop
    from vllm_deltasync.format.writer import StepFacts, StepItem, WriteOptions, write_files
    from vllm_deltasync.stores import open_store

    url = f"file://{tmp_path}/b"
    store, loop = open_store(url), default_loop()
    gen = torch.Generator().manual_seed(1)
    shapes = {"col": (40, 90), "wide": (4, 300), "row": (33, 8)}
    base = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
    new = {n: t.clone() for n, t in base.items()}
    for t in new.values():
        flat = t.view(-1)
        where = torch.randperm(flat.numel(), generator=gen)[: flat.numel() // 4]
        flat[where] = torch.randn(where.numel(), generator=gen).to(torch.bfloat16)
    new["col"][5, :] = 3.0  # one whole row changed: a row longer than a chunk is split inside it
    fp = fingerprint((n, s, "bfloat16") for n, s in shapes.items())
    totals = (3, sum(math.prod(s) for s in shapes.values()))

    def part(rank: int, kind: str, step: int) -> Manifest:
        items = []
        for name, shape in shapes.items():  # 3 'ranks': column thirds, or row thirds of "row"
            d = 0 if name == "row" else 1
            cut = [shape[d] * i // 3 for i in range(4)]
            sl = [slice(None), slice(None)]
            sl[d] = slice(cut[rank], cut[rank + 1])
            off = [0, 0]
            off[d] = cut[rank]
            box = new[name][tuple(sl)]
            local_new = box.reshape(-1)
            (region,) = blocks(shape, tuple(box.shape), off)
            if kind == "anchor":
                items.append(StepItem(name, shape, local_new.numel(), None,
                                      base[name][tuple(sl)].reshape(-1).clone(), None, region))
                continue
            local_old = base[name][tuple(sl)].reshape(-1)
            idx = torch.nonzero(local_new.view(torch.int16) != local_old.view(torch.int16)).view(-1)
            items.append(StepItem(name, shape, idx.numel(), idx, local_new[idx], local_old[idx], region))
        facts = StepFacts(step, kind, None if kind == "anchor" else 0, 0, fp, totals)  # type: ignore[arg-type]
        options = WriteOptions("sparse-v2", max_file_bytes=120, timeout_s=30, writer="abcdef0123456789")
        files, tensors = write_files(store, loop, facts, items, options, attempt=f"{rank:016x}")
        return Manifest(step, kind, None if kind == "anchor" else 0, 0, 0.0, fp, files, tensors,  # type: ignore[arg-type]
                        totals=None, run_id="0123456789abcdef", writer="abcdef0123456789")  # type: ignore[arg-type]

    for step, kind in ((0, "anchor"), (1, "delta")):
        parts = [part(r, kind, step) for r in (2, 0, 1)]  # any order
        m = merge_parts(parts, totals)
        assert all(len(t.chunks) > 3 for t in m.tensors)  # really split
        regions = [c.region for t in m.tensors if t.name != "row" for c in t.chunks]
        assert any(r is not None and r.rows > 1 for r in regions)  # whole rows of a column shard
        assert any(r is not None and r.rows == 1 for r in regions)  # a run inside one row
        loop.run(store.write(m.path, m.to_json()), 30)
    manifests, full, problems = _read(url)
    assert problems == []
    assert _bits_equal(full[0], base) and _bits_equal(full[1], new)
    strided = [c.region for c in manifests[1].tensor("col").chunks]  # type: ignore[union-attr]
    assert all(isinstance(r, Region) for r in strided)


# ---------------------------------------------------------------------------- torchrun
@pytest.mark.distributed
def test_fsdp2_two_ranks_uneven_shard_restart_and_retention(tmp_path: Path) -> None:
    """FSDP2 (``fully_shard``, dim-0 shards; vocab 101 is uneven on 2 ranks), AdamW, a publish
    every step; then a restart under a new run id. Every committed step equals the gathered
    model bit for bit; one rank ran retention and it kept another job's data."""
    bucket = tmp_path / "bucket"
    foreign = bucket / "data" / "000000000001-0bad0bad0bad0bad-0000000000000000" / "00000.safetensors"
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(b"another job's data")
    url, out = f"file://{bucket}", tmp_path / "out"
    torchrun(2, "fsdp", url, str(out), "--steps", "6")
    manifests = _check_every_step(url, out)
    # anchors at 0 and 3 (run a), 6 (restart, run b); retention keeps the 2 newest anchors
    assert sorted(manifests) == [3, 4, 5, 6, 7, 8]
    assert [manifests[s].kind for s in sorted(manifests)] == ["anchor", "delta", "delta"] * 2
    assert {manifests[s].run_id for s in (3, 4, 5)} == {"aaaa0000aaaa0000"}
    assert {manifests[s].run_id for s in (6, 7, 8)} == {"bbbb0000bbbb0000"}
    assert {m.writer for m in manifests.values()} == {"5a4dc0de5a4dc0de"}
    assert foreign.exists()  # another writer's data is never deleted
    left = {p.name.split("-")[0] for p in (bucket / "data").iterdir()}
    assert left == {f"{s:012d}" for s in (1, 3, 4, 5, 6, 7, 8)}  # 1: the foreign folder
    m = manifests[4]
    assert len(m.files) == 2  # each rank wrote its own file
    assert len(_folders_of(m, "lm_head.weight")) == 2  # 101 rows: 51 + 50, one chunk set per rank
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(len(r["times"]) == 9 for r in reports)


@pytest.mark.distributed
def test_shard1_replicate_plain_and_failpoint(tmp_path: Path) -> None:
    """``Shard(1)`` (uneven columns), ``Shard(0)``, ``Shard(2)`` of a 3-D tensor, ``Replicate()``
    and a plain tensor (replicas written once); then a rank failing mid-step: no manifest for
    that step, a clear error on every rank at the same call, recovery by an anchor."""
    url, fail_url, out = f"file://{tmp_path}/b", f"file://{tmp_path}/f", tmp_path / "out"
    torchrun(2, "tp", url, str(out), "--steps", "6", "--timeout", "20", "--fail-url", fail_url)
    manifests = _check_every_step(url, out)
    assert sorted(manifests) == list(range(6))
    assert [manifests[s].kind for s in range(6)] == ["anchor", "delta", "delta", "delta"] * 1 + ["anchor", "delta"]
    for m in manifests.values():
        assert len(_folders_of(m, "col.weight")) == 2  # one strided chunk set per rank
        for name in ("norm.weight", "plain.bias"):  # replicas: rank 0 only
            if m.tensor(name) is not None:
                assert {f[-4:] for f in _folders_of(m, name)} == {"0000"}
    col = manifests[0].tensor("col.weight")
    assert col is not None and sorted(c.region.to_json() for c in col.chunks) == [  # type: ignore[union-attr]
        [0, 6, 4, 7], [4, 6, 3, 7]]

    # the failpoint: rank 1 raises in its upload of step 2, after writing its data files
    reports = [json.loads((out / "fail" / f"rank{r}.json").read_text()) for r in (0, 1)]
    errors = [r["errors"] for r in reports]
    assert all(len(e) == 1 for e in errors), errors
    assert errors[0][0]["step"] == errors[1][0]["step"] >= 3  # the same call on every rank
    assert "step 2 is not committed: rank 1 failed: RuntimeError: failpoint" in errors[0][0]["error"]
    assert errors[1][0]["error"].startswith("RuntimeError: failpoint")
    assert all(e[0]["since_failed_step_s"] < 15 for e in errors)  # bounded, no hang
    failed = _check_every_step(fail_url, out / "fail")
    assert 2 not in failed and errors[0][0]["step"] not in failed
    after = min(s for s in failed if s > 2)
    assert failed[after].kind == "anchor" and max(failed) == 5


@pytest.mark.distributed
def test_four_ranks_fsdp_x_tp_2d_mesh(tmp_path: Path) -> None:
    """4 ranks: a 2-D mesh (``Shard(0)`` over dp, ``Shard(1)`` over tp; ``Replicate`` over dp)."""
    url, out = f"file://{tmp_path}/b", tmp_path / "out"
    torchrun(4, "tp", url, str(out), "--steps", "4")
    manifests = _check_every_step(url, out)
    assert sorted(manifests) == [0, 1, 2, 3]
    m = manifests[0]
    assert len(_folders_of(m, "fsdp_tp.weight")) == 4
    assert len(_folders_of(m, "dp_rep.weight")) == 2  # replicated over dp: written by dp rank 0


@pytest.mark.distributed
def test_ranks_holding_a_parameter_differently_fail_the_publish_on_every_rank(tmp_path: Path) -> None:
    """``w`` a plain tensor on rank 0, a ``Shard(0)`` DTensor on rank 1: both ranks raise at
    that call naming ``w`` and both placements, nothing of the step is committed, and the next
    step (placed alike) is an anchor that reads back bit for bit."""
    url, out = f"file://{tmp_path}/b", tmp_path / "out"
    torchrun(2, "placement", url, str(out), "--timeout", "20")
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(reports):
        (error,) = report["errors"]
        assert error["step"] == 0, error
        assert error["error"].startswith(f"PublishError: step 0 (rank {rank}): not published, "
                                         "tensor 'w': rank 0 holds it as a plain tensor (a replica, "
                                         "written by rank 0), rank 1 as a DTensor with placements "
                                         "(Shard(dim=0),) on a mesh of shape (2,)"), error
    manifests = _check_every_step(url, out)
    assert sorted(manifests) == [1, 2] and manifests[1].kind == "anchor"
    assert not list((tmp_path / "b" / "data").glob(f"{0:012d}-*"))  # nothing of step 0 written


def _part(store: Any, step: int, writer: str, attempt: str, name: str = "w") -> Manifest:
    """One rank's files and part record (rank = the attempt's last 4 hex digits)."""
    from vllm_deltasync._loop import default_loop
    from vllm_deltasync.format.writer import StepFacts, StepItem, WriteOptions, write_files
    from vllm_deltasync.trainer.sharded import PART_NAME, folder, part_manifest

    loop = default_loop()
    rank = int(attempt[-4:], 16)
    values = torch.full((4,), float(rank + 1)).to(torch.bfloat16)
    item = StepItem(name, (8,), 4, None, values, None, Region(rank * 4, 1, 4, 4))
    facts = StepFacts(step, "anchor", None, step, fingerprint([(name, (8,), "bfloat16")]), (1, 8))
    files, tensors = write_files(store, loop, facts, [item],
                                 WriteOptions("sparse-v2", max_file_bytes=1 << 20, timeout_s=30, writer=writer),
                                 attempt=attempt)
    template = Manifest(step, "anchor", None, step, 0.0, fingerprint([(name, (8,), "bfloat16")]), (), (),
                        totals=None, run_id="0123456789abcdef", writer=writer)  # type: ignore[arg-type]
    part = part_manifest(template, files, tensors)
    loop.run(store.write(f"{folder(step, writer, attempt)}/{PART_NAME}", part.to_json()), 30)
    return part


@pytest.mark.parametrize("planted", ["extra-rank", "alias", "instead-of-rank-1", "stray-files", "garbage"])
def test_a_planted_part_record_is_a_clear_error(tmp_path: Path, planted: str) -> None:
    """A part record of no rank of the job (rank 5 of 2, a second name for rank 1, one in place
    of a missing rank), one listing files outside its folder, or one that is not JSON: one
    PublishError naming it, never a KeyError, nothing committed."""
    from vllm_deltasync._loop import default_loop
    from vllm_deltasync.errors import PublishError
    from vllm_deltasync.stores import open_store
    from vllm_deltasync.trainer.sharded import PART_NAME, collect_parts, folder

    writer, session = "abcdef0123456789", "a1b2c3d4e5f6"
    store, loop = open_store(f"file://{tmp_path}/b"), default_loop()
    _part(store, 3, writer, f"{session}0000")
    if planted != "instead-of-rank-1":
        _part(store, 3, writer, f"{session}0001")
    expect = "is a record of no rank of this job"
    if planted in ("extra-rank", "instead-of-rank-1"):
        _part(store, 3, writer, f"{session}0005")
    elif planted == "alias":
        _part(store, 3, writer, f"{session}00001")
    elif planted == "stray-files":  # rank 1's record rewritten to list rank 0's file
        path = f"{folder(3, writer, session + '0001')}/{PART_NAME}"
        doc = json.loads(loop.run(store.read(path), 30))
        doc["files"][0]["path"] = doc["files"][0]["path"].replace(f"{session}0001", f"{session}0000")
        loop.run(store.write(path, json.dumps(doc).encode(), overwrite=True), 30)
        expect = "outside its folder; it is not this job's"
    else:
        path = f"{folder(3, writer, session + '0001')}/{PART_NAME}"
        loop.run(store.write(path, b"not json", overwrite=True), 30)
        expect = "step 3 is not committed: data/"
    with pytest.raises(PublishError, match=expect) as err:
        loop.run(collect_parts(store, 3, writer, session, 2, timeout_s=2), 30)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "b" / "manifests").exists()
    loop.run(store.close(), 30)


@pytest.fixture
def one_rank(tmp_path: Path) -> Any:
    """A one-process gloo job in this process (world size 1), torn down afterwards."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_anything_else_is_refused_with_one_error(one_rank: Any, tmp_path: Path) -> None:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import Partial, _StridedShard

    from vllm_deltasync import DeltaPublisher
    from vllm_deltasync.errors import PublishError

    ok = DTensor.from_local(torch.ones(4, 3), one_rank, [Shard(0)])
    for bad in ([Partial()], [_StridedShard(0, split_factor=2)]):
        odd = DTensor.from_local(torch.ones(4, 3), one_rank, bad)
        with DeltaPublisher(f"file://{tmp_path}/b{len(str(bad))}", timeout_s=10) as pub:
            with pytest.raises(PublishError, match=r"tensor 'odd': placement .* is not supported; "
                               r"a sharded publish takes Shard\(dim\) and Replicate\(\)"):
                pub.publish(0, [("ok", ok), ("odd", odd)])
            pub.publish(1, [("ok", ok), ("odd", ok)])  # the same publisher goes on
        m, full, problems = _read(f"file://{tmp_path}/b{len(str(bad))}")
        assert sorted(m) == [1] and problems == [] and m[1].kind == "anchor"


def test_one_rank_job_publishes_like_a_single_process(one_rank: Any, tmp_path: Path) -> None:
    """World size 1: the sharded path (group, part record, merge) gives the same steps."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from vllm_deltasync import DeltaPublisher

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(8, 6, generator=gen)
    url = f"file://{tmp_path}/b"
    truth = {}
    with DeltaPublisher(url, anchor_every=3, timeout_s=10) as pub:
        for step in range(4):
            w.view(-1)[step * 5: step * 5 + 7] += 0.1
            pub.publish(step, [("w", DTensor.from_local(w.clone(), one_rank, [Shard(1)])),
                               ("r", DTensor.from_local(w[0].clone(), one_rank, [Replicate()]))])
            truth[step] = {"w": w.to(torch.bfloat16), "r": w[0].to(torch.bfloat16)}
        pub.flush()
        assert pub.stats.steps == 4 and pub.stats.anchors == 2
    manifests, full, problems = _read(url)
    assert problems == [] and sorted(manifests) == [0, 1, 2, 3]
    for step in range(4):
        assert _bits_equal(full[step], truth[step])


def test_plain_tensors_stay_single_process_under_a_process_group(one_rank: Any, tmp_path: Path) -> None:
    """A DDP trainer publishing plain tensors (from rank 0 only) makes no collective at all."""
    from torch.distributed.tensor import DTensor, Shard

    from vllm_deltasync import DeltaPublisher
    from vllm_deltasync.errors import PublishError

    with DeltaPublisher(f"file://{tmp_path}/b", timeout_s=10) as pub:
        pub.publish(0, {"w": torch.ones(3, 2)})
        assert pub._group is None
        with pytest.raises(PublishError, match="published plain tensors before"):
            pub.publish(1, {"w": DTensor.from_local(torch.ones(3, 2), one_rank, [Shard(0)])})
    with pytest.raises(PublishError, match="closed"):
        pub.publish(2, {"w": torch.ones(3, 2)})
    manifests, _, problems = _read(f"file://{tmp_path}/b")
    assert sorted(manifests) == [0] and problems == []

"""Sharded trainers: one step published from many ranks, nothing gathered (docs/trainer.md).

``DeltaPublisher.publish`` switches here when any tensor it is given is a DTensor (FSDP2,
tensor parallel). Then every rank of the job calls ``publish`` for every step, and:

* each rank keeps a bf16 copy of the shards it holds (replicas: only the rank at coordinate 0
  of every ``Replicate`` mesh dim), diffs them, and writes the changed elements as format v2
  chunks in checkpoint coordinates (``describe`` / ``blocks``: a shard is one or a few regions
  of the full tensor, strided for column shards) to its own data folder
  ``data/{step}-{writer}-{session}{rank:04x}``, then a **part record** ``part.json`` there
  (a v2 manifest of its own files and chunks);
* global rank 0 (the committer) collects every rank's part record from the bucket, with a
  timeout, merges them into the step's manifest and commits it, then runs retention;
* a rank whose upload fails writes ``abort.json`` instead, so the committer stops waiting;
* at the start of each ``publish`` (and in ``flush``/``close``) the ranks exchange one small
  record over a **dedicated gloo group**, from the calling thread only: the step, the parameter
  set and any error. Every rank therefore raises at the same call and makes the same
  anchor/delta choice afterwards. No collective ever runs on a background thread or on the
  trainer's own process groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import math
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import product
from typing import Any

import torch

from vllm_deltasync import failpoints
from vllm_deltasync.errors import FormatError, PublishError
from vllm_deltasync.format.layout import DATA_DIR, STEP_DIGITS
from vllm_deltasync.format.manifest import (
    Chunk,
    FileEntry,
    Manifest,
    Region,
    TensorEntry,
    Totals,
)
from vllm_deltasync.stores import Store

PART_NAME = "part.json"
ABORT_NAME = "abort.json"


def has_dtensor(pairs: Sequence[tuple[str, Any]]) -> bool:
    """True when any tensor is a DTensor (the call is then collective)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support
        return False
    return any(isinstance(t, DTensor) for _, t in pairs)


@dataclass
class LocalShard:
    """What this rank holds of one parameter."""

    name: str
    shape: tuple[int, ...]
    """The full (checkpoint) shape."""
    dtype: torch.dtype
    local: torch.Tensor | None
    """This rank's piece (a view, not a copy), or None when another rank writes it."""
    blocks: tuple[Region, ...]
    """Where the local piece lies in the full tensor, in the local piece's flat order."""
    placement: str = "a plain tensor (a replica, written by rank 0)"
    """How this rank holds it, in words (every rank of the job must say the same)."""


def blocks(shape: Sequence[int], local: Sequence[int], offset: Sequence[int]) -> tuple[Region, ...]:
    """Regions of the full tensor covered by the box ``offset + [0, local)``, in the box's order.

    Contiguous when only dim 0 is cut (one region); otherwise one strided region per index of
    the dims before the last two that are cut (one region for a 2-D column shard).
    """
    n = len(shape)
    if any(d == 0 for d in local):
        return ()
    if n == 0:
        return (Region(0, 1, 1, 1),)
    cut = [d for d in range(n) if local[d] != shape[d] or offset[d] != 0]
    k = cut[-1] if cut else -1
    inner = math.prod(shape[k + 1:]) if k >= 0 else math.prod(shape)
    if k <= 0:
        start = offset[0] * inner if k == 0 else 0
        length = local[0] * inner if k == 0 else inner
        return (Region(start, 1, length, length),)
    row_len, row_stride = local[k] * inner, shape[k] * inner
    strides = [math.prod(shape[d + 1:]) for d in range(n)]
    out = []
    for outer in product(*(range(local[d]) for d in range(k - 1))):
        base = sum((offset[d] + i) * strides[d] for d, i in enumerate(outer))
        first = base + offset[k - 1] * strides[k - 1] + offset[k] * inner
        out.append(Region(first, local[k - 1], row_len, row_stride))
    return tuple(out)


def describe(name: str, tensor: torch.Tensor, rank: int) -> LocalShard:
    """This rank's piece of ``tensor``; a plain tensor is a replica written by rank 0.

    Supported DTensor placements: ``Shard(dim)`` and ``Replicate()`` on any mesh (FSDP2,
    tensor parallel, 2-D FSDP x TP), uneven shards included. Anything else is refused.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        shape = tuple(tensor.shape)
        return LocalShard(name, shape, tensor.dtype, tensor if rank == 0 else None,
                          blocks(shape, shape, (0,) * len(shape)))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(tensor.placements)
    for i, p in enumerate(placements):
        if type(p) is not Shard and type(p) is not Replicate:
            raise PublishError(
                f"tensor {name!r}: placement {p} on mesh dim {i} (placements {placements}) is not "
                "supported; a sharded publish takes Shard(dim) and Replicate() placements "
                "(FSDP2, tensor parallel, 2-D FSDP x TP). Redistribute this parameter, or pass "
                "its .full_tensor()"
            )
    mesh = tensor.device_mesh
    coord = mesh.get_coordinate()
    shape = tuple(tensor.shape)
    how = f"a DTensor with placements {placements} on a mesh of shape {tuple(mesh.shape)}"
    if coord is None:  # this rank is not on the parameter's mesh
        return LocalShard(name, shape, tensor.dtype, None, (), how)
    writes = all(c == 0 for c, p in zip(coord, placements, strict=True) if type(p) is Replicate)
    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise PublishError(f"tensor {name!r}: its local shard is {list(local.shape)}, its placements "
                           f"{placements} say {list(local_shape)}; it cannot be placed in the checkpoint")
    return LocalShard(name, shape, tensor.dtype, local if writes else None,
                      blocks(shape, local_shape, offset) if writes else (), how)


def placement_digest(shards: Mapping[str, LocalShard]) -> str:
    """A short digest of how this rank holds every parameter (exchanged in the agreement
    record: ranks that hold one parameter differently must not commit anything)."""
    digest = hashlib.sha256()
    for name in sorted(shards):
        digest.update(f"{name}\0{shards[name].placement}\0".encode())
    return digest.hexdigest()[:16]


def placement_disagreement(group: RankGroup, step: int, shards: Mapping[str, LocalShard]) -> str:
    """Collective (every rank, after the digests differed): the first parameter the ranks hold
    differently, named with two of its placements, as one line."""
    everyone = group.gather({name: s.placement for name, s in shards.items()}, f"step {step}")
    for name in sorted(everyone[0]):
        seen = [(r, held.get(name, "nothing")) for r, held in enumerate(everyone)]
        other = next(((r, how) for r, how in seen if how != seen[0][1]), None)
        if other is not None:
            return (f"tensor {name!r}: rank 0 holds it as {seen[0][1]}, rank {other[0]} as "
                    f"{other[1]}; every rank passes each parameter the same way (all DTensors "
                    f"with the same placements, or all plain tensors). Step {step} is not "
                    "published on any rank")
    return (f"the ranks hold their parameters differently (placements) at step {step}; every "
            "rank passes each parameter the same way. Nothing is published")


# ---------------------------------------------------------------------------- the group
class RankGroup:
    """The dedicated gloo group of one sharded publisher, used from the calling thread only."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise PublishError("DTensor parameters need torch.distributed to be initialized")
        self.timeout_s = timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # every rank of the job is here (the first collective publish): a new group is collective
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.session = ""
        self.broken: str | None = None

    def start(self, run_id: str, writer: str, explicit: tuple[bool, bool]) -> tuple[str, str]:
        """Agree on the run id, writer token and session (rank 0's); returns (run_id, writer).

        A token a rank did not pass is rank 0's; one it passed must equal rank 0's.
        """
        everyone = self.gather((run_id, writer, explicit, secrets.token_hex(6)), "starting")
        run0, writer0, _, session = everyone[0]
        clash = [r for r, (run, w, (run_given, writer_given), _) in enumerate(everyone)
                 if (run_given and run != run0) or (writer_given and w != writer0)]
        if clash:
            raise PublishError(f"ranks {clash} passed a run_id or writer_token other than rank 0's "
                               f"(run {run0}, writer {writer0}); every rank of one job passes the "
                               "same ones, or none (rank 0's are then used)")
        self.session = session
        return run0, writer0

    def gather(self, record: Any, what: str) -> list[Any]:
        """``all_gather_object`` on the dedicated group; a timeout breaks the publisher."""
        import torch.distributed as dist

        if self.broken:
            raise PublishError(self.broken)
        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, record, group=self.group)
        except Exception as exc:  # gloo timeout or a peer gone
            self.broken = (f"rank {self.rank}: the ranks did not all reach the publisher ({what}) "
                           f"within {self.timeout_s:.0f}s: {type(exc).__name__}: {exc}. Every rank "
                           "must call publish/flush/close for every step; this publisher is closed")
            raise PublishError(self.broken) from exc
        return out

    def attempt(self, rank: int | None = None) -> str:
        """The attempt part of a rank's data folder name: ``{session}{rank:04x}``."""
        return f"{self.session}{self.rank if rank is None else rank:04x}"

    def close(self) -> None:
        import torch.distributed as dist

        if not self.broken and dist.is_initialized():
            with contextlib.suppress(Exception):  # the default group may already be gone
                dist.destroy_process_group(self.group)


# ---------------------------------------------------------------------------- part records
def folder(step: int, writer: str, attempt: str) -> str:
    return f"{DATA_DIR}/{step:0{STEP_DIGITS}d}-{writer}-{attempt}"


def part_manifest(template: Manifest, files: tuple[FileEntry, ...],
                  tensors: tuple[TensorEntry, ...]) -> Manifest:
    """A rank's part record: a v2 manifest of its own files and chunks."""
    return replace(template, files=files, tensors=tensors,
                   totals=Totals(len(tensors), sum(t.numel for t in tensors),
                                 sum(t.changed for t in tensors), sum(f.size for f in files)))


def failpoint(rank: int, step: int) -> None:
    """Test-only (``failpoints.py``, ``shard=<rank>/<step>``)."""
    if (str(rank), str(step)) in failpoints.armed("shard"):
        raise RuntimeError(f"failpoint shard: rank {rank} fails step {step} after writing its "
                           "data files")


_RANK_SUFFIX = re.compile(r"[0-9a-f]{4,}")


def _rank_of(suffix: str, world: int) -> int | None:
    """The rank of a folder ``{session}{rank:04x}`` of this job, or None: not a name this job
    writes (another width, out of range)."""
    if not _RANK_SUFFIX.fullmatch(suffix):
        return None
    rank = int(suffix, 16)
    return rank if rank < world and suffix == f"{rank:04x}" else None


async def _read_part(store: Store, path: str, step: int, writer: str, folder_of: str) -> Manifest:
    """A rank's part record, checked: parses, is of ``step`` and ``writer``, lists only files
    in the rank's own folder. PublishError naming the path otherwise."""
    try:
        part = Manifest.from_json(await store.read(path), source=path)
    except FormatError as exc:
        raise PublishError(f"step {step} is not committed: {exc}") from exc
    stray = [f.path for f in part.files if not f.path.startswith(folder_of + "/")]
    if part.step != step or part.writer != writer or stray:
        why = (f"lists {stray[0]}, outside its folder" if stray
               else f"is of step {part.step}, writer {part.writer}")
        raise PublishError(f"step {step} is not committed: the part record {path} {why}; it is "
                           "not this job's (a planted or stale record); remove it")
    return part


PART_READS = 32
"""Part records the committing rank reads at once."""


async def collect_parts(store: Store, step: int, writer: str, session: str, world: int,
                        timeout_s: float) -> list[Manifest]:
    """Every rank's part record of ``step``, rank order; PublishError on an abort, a timeout,
    or a part or abort record that no rank of this job writes (planted, or a duplicate name)."""
    prefix = f"{DATA_DIR}/{step:0{STEP_DIGITS}d}-{writer}-{session}"
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        found: dict[int, str] = {}
        aborted: dict[int, str] = {}
        for o in await store.list(prefix):
            head, _, name = o.path.rpartition("/")
            if name not in (ABORT_NAME, PART_NAME):
                continue
            rank = _rank_of(head[len(prefix):], world)
            if rank is None:
                raise PublishError(
                    f"step {step} is not committed: {o.path} is a record of no rank of this job "
                    f"(world size {world}; rank folders are {prefix}<rank as 4 hex digits>); "
                    "something else writes into this job's data folders: remove it and check "
                    "that no other process uses this writer token")
            (aborted if name == ABORT_NAME else found)[rank] = o.path
        if aborted:
            rank = min(aborted)
            why = (await store.read(aborted[rank])).decode("utf-8", "replace")
            raise PublishError(f"step {step} is not committed: rank {rank} failed: {why}")
        if len(found) == world:
            return await _read_parts(store, [found[r] for r in range(world)], step, writer)
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(found))
            raise PublishError(f"step {step} is not committed: ranks {missing[:8]} wrote no part "
                               f"within {timeout_s:.0f}s (dead, or not calling publish)")
        await asyncio.sleep(pause)
        pause = min(0.2, pause * 2)


async def _read_parts(store: Store, paths: list[str], step: int, writer: str) -> list[Manifest]:
    """The part records at ``paths``, in order, read at once (bounded): 256 ranks' records
    take ~8 round trips, not 256."""
    gate = asyncio.Semaphore(PART_READS)

    async def read(path: str) -> Manifest:
        async with gate:
            return await _read_part(store, path, step, writer, path.rpartition("/")[0])

    return list(await asyncio.gather(*(read(p) for p in paths)))


def _key(m: Manifest) -> tuple[Any, ...]:
    return (m.kind, m.base_step, m.anchor_step, m.fingerprint[:15], m.run_id, m.writer)


def merge_parts(parts: list[Manifest], totals: tuple[int, int]) -> Manifest:
    """The step's manifest: every rank's files, chunks renumbered, tensors merged by name."""
    first = parts[0]
    key = (first.kind, first.base_step, first.anchor_step, first.fingerprint, first.run_id, first.writer)
    files: list[FileEntry] = []
    merged: dict[str, tuple[TensorEntry, list[Chunk], int]] = {}
    for rank, part in enumerate(parts):
        if (part.kind, part.base_step, part.anchor_step, part.fingerprint, part.run_id, part.writer) != key:
            raise PublishError(f"step {first.step}: rank {rank}'s part (kind, base, anchor, "
                               f"fingerprint, run, writer) is {_key(part)}, rank 0's {_key(first)}; "
                               "the ranks disagree (not committed)")
        base = len(files)
        files.extend(part.files)
        for t in part.tensors:
            chunks = [replace(c, file=c.file + base) for c in t.chunks]
            if t.name in merged:
                entry, acc, changed = merged[t.name]
                if (entry.shape, entry.encoding) != (t.shape, t.encoding):
                    raise PublishError(f"step {first.step}: tensor {t.name!r} differs between ranks")
                acc.extend(chunks)
                merged[t.name] = (entry, acc, changed + t.changed)
            else:
                merged[t.name] = (t, chunks, t.changed)
    tensors = tuple(replace(entry, changed=changed, chunks=tuple(chunks))
                    for entry, chunks, changed in merged.values())
    return replace(first, created_at=time.time(), files=tuple(files), tensors=tensors,
                   totals=Totals(totals[0], totals[1], sum(t.changed for t in tensors),
                                 sum(f.size for f in files)))


__all__ = ["LocalShard", "RankGroup", "blocks", "collect_parts", "describe",
           "has_dtensor", "merge_parts", "placement_digest", "placement_disagreement"]

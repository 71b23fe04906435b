"""Writing one step into a bucket: data files, then the manifest.

Used by the publisher's upload thread. ``write_step`` encodes each tensor's payload in
chunks, packs chunks into safetensors files of about ``max_file_bytes`` (``_datafiles.py``),
writes the files (a few at a time) and finally the manifest, whose existence commits the
step. Retention (``retain``, re-exported here) is ``retention.py``.

Chunks encode on a thread pool (``encode_threads``; the codecs release the GIL in numba,
numpy, torch and zstd) a bounded window ahead of the packing, which takes them in their
order: the files and the manifest are the same bytes as with one thread, the upload of a
full file starts while later chunks still encode, and at most ``2 * encode_threads``
encoded chunks (each at most about ``max_file_bytes``) wait besides the open file and
``MAX_WRITES_IN_FLIGHT`` files being written.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from vllm_deltasync._loop import BackgroundLoop
from vllm_deltasync.errors import ConfigError, FormatError
from vllm_deltasync.format._datafiles import DataFiles, PendingChunk
from vllm_deltasync.format.adapter import AdapterInfo
from vllm_deltasync.format.codec import Codec
from vllm_deltasync.format.codecs import get_codec
from vllm_deltasync.format.layout import manifest_path
from vllm_deltasync.format.limits import name_problem, shape_problem, shown, step_problem
from vllm_deltasync.format.manifest import (
    SCHEMA_VERSION,
    FileEntry,
    Kind,
    Manifest,
    Region,
    TensorEntry,
    Totals,
    manifest_identity,
)
from vllm_deltasync.format.retention import retain
from vllm_deltasync.stores import Store

MAX_ENCODE_THREADS = 8
"""``encode_threads=0`` uses one thread per available core, at most this many."""
INLINE_ELEMENTS = 1 << 20
"""A step carrying fewer elements (changed ones, or an anchor's) encodes on the calling thread:
its chunks encode in a few milliseconds, and the pool's hand-overs would cost more than they
save (the bytes do not depend on it)."""


def encode_threads_for(encode_threads: int) -> int:
    """Threads that encode chunks: ``encode_threads``, or for 0 one per core this process may
    run on, at most ``MAX_ENCODE_THREADS``."""
    if isinstance(encode_threads, bool) or not isinstance(encode_threads, int) or encode_threads < 0:
        raise ConfigError(f"encode_threads={encode_threads!r} must be an integer >= 0 (0: one per core)")
    if encode_threads:
        return encode_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_ENCODE_THREADS, cores))


@dataclass
class StepItem:
    """One tensor's payload for one step, as the publisher's diff produced it."""

    name: str
    shape: tuple[int, ...]
    changed: int
    indices: torch.Tensor | None
    """int64 sorted flat indices of changed elements; None: dense (anchor), all elements."""
    new_values: torch.Tensor
    """bf16: all elements (dense) or the changed ones."""
    old_values: torch.Tensor | None
    """bf16 base values at ``indices`` (deltas), else None."""
    region: Region | None = None
    """A block of the tensor (one rank's shard): ``indices`` and ``new_values`` are in its
    local index space (docs/format.md, "Region and local indices"). None: the whole tensor."""


def shifted(indices: torch.Tensor, by: int) -> torch.Tensor:
    """``indices - by`` (int64), on the calling thread where ``indices`` are on the host:
    torch splits a large subtraction over its intra-op threads, and their fork and join on a
    busy host cost far more than the subtraction (~10 ms measured for 58K indices on 2 shared
    cores, against ~0.05 ms in numpy)."""
    if indices.device.type != "cpu":
        return indices - by
    return torch.from_numpy(indices.numpy() - by)


_Plan = tuple[int, int, torch.Tensor | None, Region | None, int]
"""One chunk to encode: (start, stop, local indices or None, region, codec key)."""


def _plan_item(item: StepItem, codec: Codec, files: DataFiles) -> Iterator[_Plan]:
    """The chunks of ``item``, in order (nothing encoded here)."""
    if item.region is not None:
        yield from _plan_block(item, item.region, codec, files)
        return
    count = item.new_values.numel()
    per_chunk = max(1, files.max_file_bytes // codec.max_bytes_per_element)
    for start in range(0, count, per_chunk):
        stop = min(count, start + per_chunk)
        indices = None if item.indices is None else item.indices[start:stop]
        region = None
        if files.version >= 2:  # the chunk's own index space: [first, last] of its indices
            if indices is None:
                region = Region(start, 1, stop - start, stop - start)
            else:
                first, last = int(indices[0]), int(indices[-1])
                region = Region(first, 1, last - first + 1, last - first + 1)
                indices = shifted(indices, first)
        yield start, stop, indices, region, start


def _encode_chunk(item: StepItem, codec: Codec, plan: _Plan
                  ) -> tuple[PendingChunk, dict[str, torch.Tensor]]:
    """Encode positions ``[start, stop)`` of ``item``'s payload: the chunk and its tensors
    (safetensors key -> tensor). Runs on the encode pool."""
    start, stop, indices, region, codec_key = plan
    old = None if item.old_values is None else item.old_values[start:stop]
    roles, meta = codec.encode(indices, item.new_values[start:stop], old)
    keys = {role: codec.key(item.name, role, codec_key) for role in roles}
    pending = PendingChunk(item.name, keys, start, stop, dict(meta), region)
    return pending, {keys[r]: t.reshape(-1).contiguous() for r, t in roles.items()}


def _plan_block(item: StepItem, block: Region, codec: Codec, files: DataFiles) -> Iterator[_Plan]:
    """Chunks of one block (a rank's shard) of a tensor, v2 only.

    Every chunk's region lies inside ``block``: either whole rows of it (a strided region,
    rows no other chunk touches) or a run inside one row (a contiguous region), so chunks of
    one block, and of disjoint blocks written by other ranks, never overlap. Safetensors keys
    are suffixed with the chunk's first flat element, unique within the tensor.
    """
    if files.version < 2:
        raise FormatError(f"tensor {item.name!r}: a block of a tensor (a shard) needs format v2")
    per_chunk = max(1, files.max_file_bytes // codec.max_bytes_per_element)
    row_len, rows = block.row_len, block.rows
    if rows == 1:  # a contiguous block: rows of one element are the simplest split
        row_len = max(1, block.row_len)

    def flat(local: int) -> int:
        return block.offset + (local // row_len) * block.row_stride + local % row_len

    if item.indices is None:  # dense: whole rows, or pieces of one row when a row is too long
        if rows == 1 or row_len > per_chunk:
            for r in range(rows):
                for c0 in range(0, row_len, per_chunk):
                    n = min(per_chunk, row_len - c0)
                    start = r * row_len + c0
                    region = Region(flat(start), 1, n, n)
                    yield start, start + n, None, region, region.offset
            return
        per_rows = max(1, per_chunk // row_len)
        for r0 in range(0, rows, per_rows):
            n_rows = min(per_rows, rows - r0)
            start, stop = r0 * row_len, (r0 + n_rows) * row_len
            region = Region(flat(start), n_rows, row_len, block.row_stride)
            yield start, stop, None, region, region.offset
        return
    idx = item.indices
    count = idx.numel()
    row_of = idx // row_len if rows > 1 else None
    start = 0
    while start < count:
        if row_of is None:  # contiguous block: [first, last] of the chunk's indices
            stop = min(count, start + per_chunk)
            first, last = int(idx[start]), int(idx[stop - 1])
            region = Region(flat(first), 1, last - first + 1, last - first + 1)
            local = shifted(idx[start:stop], first)
        else:
            r = int(row_of[start])
            row_begin = int(torch.searchsorted(idx, r * row_len))
            row_end = int(torch.searchsorted(idx, (r + 1) * row_len))
            if start > row_begin or row_end - start > per_chunk:  # inside one row
                stop = min(row_end, start + per_chunk)
                first, last = int(idx[start]), int(idx[stop - 1])
                region = Region(flat(first), 1, last - first + 1, last - first + 1)
                local = shifted(idx[start:stop], first)
            else:  # whole rows r .. r_last, as many as fit
                cand = min(count, start + per_chunk)
                stop = count if cand == count else int(torch.searchsorted(idx, int(row_of[cand]) * row_len))
                r_last = int(row_of[stop - 1])
                region = Region(flat(r * row_len), r_last - r + 1, row_len, block.row_stride)
                local = shifted(idx[start:stop], r * row_len)
        yield start, stop, local, region, region.offset
        start = stop


def _in_order(jobs: Iterator[tuple[int, Callable[[], Any]]], threads: int,
              executor: Executor | None = None) -> Generator[tuple[int, Any], None, None]:
    """``(tag, job())`` for each ``(tag, job)``, in order; ``threads > 1``: the jobs run on
    ``executor`` (or a pool of ``threads`` made for this call), at most ``2 * threads`` started
    and not yet taken. The first error is raised in order; jobs not started then never start."""
    if threads <= 1:
        for tag, job in jobs:
            yield tag, job()
        return
    if executor is None:
        with ThreadPoolExecutor(threads, thread_name_prefix="deltasync-encode") as pool:
            yield from _in_order(jobs, threads, pool)
        return
    window: collections.deque[tuple[int, Future[Any]]] = collections.deque()
    try:
        for tag, job in jobs:
            window.append((tag, executor.submit(job)))
            if len(window) >= 2 * threads:
                tag0, future = window.popleft()
                yield tag0, future.result()
        while window:
            tag0, future = window.popleft()
            yield tag0, future.result()
    finally:
        for _, future in window:
            future.cancel()
        for _, future in window:  # a job already running ends before the caller goes on
            if not future.cancelled():
                future.exception()


@dataclass(frozen=True)
class StepFacts:
    """What a step is, as its manifest records it (besides files and tensors)."""

    step: int
    """The step number (0 to 10**12 - 1)."""
    kind: Kind
    """``"anchor"`` (every element) or ``"delta"`` (the changed ones)."""
    base_step: int | None
    """A delta: the step it applies on. An anchor: None."""
    anchor_step: int
    """The anchor its chain starts from (an anchor's own step)."""
    fingerprint: str
    """The parameter set's ``fingerprint``."""
    totals: tuple[int, int]
    """Tensors and elements of the whole parameter set (not only those written)."""
    base_id: str | None = None
    """Format v2+ delta: the identity of the manifest it was computed from."""
    resumed_from: int | None = None
    """Format v2+ anchor, optional: the checkpoint step a restarted trainer resumed from."""
    adapter: AdapterInfo | None = None
    """Format v2+, an adapter bucket's step (``lora="adapter"``): the manifest's ``adapter``
    record (format/adapter.py)."""

    def __post_init__(self) -> None:
        """The step numbers are ones a reader reads (``limits.py``); FormatError otherwise."""
        if self.kind not in ("anchor", "delta"):
            raise FormatError(f"step {self.step}: kind {self.kind!r} is neither 'anchor' nor 'delta'")
        for label, value in (("step", self.step), ("anchor_step", self.anchor_step),
                             ("base_step", self.base_step), ("resumed_from", self.resumed_from)):
            problem = None if value is None and label in ("base_step", "resumed_from") else step_problem(value)
            if problem is not None:
                raise FormatError(f"step {self.step}: {label} = {shown(value)} {problem}; no "
                                  "reader reads such a step")


@dataclass(frozen=True)
class WriteOptions:
    """How a step's data files and manifest are written."""

    codec: str
    """The codec of sparse items (dense items, an anchor's, are always ``dense``)."""
    max_file_bytes: int = 256 << 20
    """Data files are packed to about this size."""
    timeout_s: float = 600.0
    """Limit in seconds for one store operation."""
    version: int = SCHEMA_VERSION
    """Format version: 3, 2 (need ``run_id`` and ``writer`` for a step) or 1."""
    run_id: str | None = None
    """Format v2+: the training run (lowercase hex)."""
    writer: str | None = None
    """Format v2+: the writer token (lowercase hex); names the data folders."""
    encode_threads: int = 0
    """Threads that encode chunks (0: one per core, at most 8); the bytes do not depend on it."""

    def __post_init__(self) -> None:
        if self.version not in (1, 2, 3) or isinstance(self.version, bool):
            raise ConfigError(f"WriteOptions: version={self.version!r} must be 3, 2 or 1")
        size = self.max_file_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"WriteOptions: max_file_bytes={size!r} must be an integer >= 1")
        encode_threads_for(self.encode_threads)  # checks it
        try:
            get_codec(self.codec)
        except FormatError as exc:
            raise ConfigError(f"WriteOptions: {exc}") from None

    @property
    def tokens(self) -> tuple[str | None, str | None]:
        """``(run_id, writer)`` as the format version writes them (v1: none)."""
        return (self.run_id, self.writer) if self.version >= 2 else (None, None)


def write_files(store: Store, loop: BackgroundLoop, facts: StepFacts, items: list[StepItem],
                options: WriteOptions, *, attempt: str | None = None, executor: Executor | None = None,
                ) -> tuple[tuple[FileEntry, ...], tuple[TensorEntry, ...]]:
    """Encode ``items`` and write their data files (one attempt folder); no manifest.

    Returns the file entries and one tensor entry per item, chunks numbered into those files.
    The ranks of a sharded job each call this for their own blocks; one of them merges the
    results into the manifest (``trainer/sharded.py``). ``executor``: the pool that encodes
    (one of ``options.encode_threads`` threads is made for the call if None).
    """
    files, entries = _encode_and_pack(store, loop, facts, items, options, attempt, executor)
    return files.wait(), entries


def _encode_and_pack(store: Store, loop: BackgroundLoop, facts: StepFacts, items: list[StepItem],
                     options: WriteOptions, attempt: str | None, executor: Executor | None,
                     gate: Future[Any] | None = None) -> tuple[DataFiles, tuple[TensorEntry, ...]]:
    """Encode ``items`` into data files; the last file's write is started, not waited for
    (``DataFiles.wait``). Returns the files and one tensor entry per tensor."""
    for item in items:  # before anything is encoded or written
        problem = name_problem(item.name) or shape_problem(item.shape)
        if problem is not None:
            raise FormatError(f"step {facts.step}: tensor {str(item.name)[:80]!r} {problem}; no "
                              "reader reads such a tensor, nothing was written")
    threads = encode_threads_for(options.encode_threads)
    if sum(item.new_values.numel() for item in items) < INLINE_ELEMENTS:
        threads = 1  # a small step: handing its chunks to other threads costs more than it saves
    files = DataFiles(store, loop, facts.step, facts.kind, options.max_file_bytes, options.timeout_s,
                      options.version, options.tokens[1], attempt, gate)
    dense, sparse = get_codec("dense"), get_codec(options.codec)
    pending: list[tuple[StepItem, Codec, list[PendingChunk]]] = []
    for item in items:
        pending.append((item, dense if item.indices is None else sparse, []))

    def jobs() -> Iterator[tuple[int, Callable[[], Any]]]:
        for k, (item, codec_of, _) in enumerate(pending):
            for plan in _plan_item(item, codec_of, files):
                yield k, functools.partial(_encode_chunk, item, codec_of, plan)

    try:
        with contextlib.closing(_in_order(jobs(), threads, executor)) as encoded:
            for k, (chunk, tensors) in encoded:  # an error: the pool stops
                files.add(pending[k][0].name, tensors, chunk)
                pending[k][2].append(chunk)
        files.flush()
    except BaseException:
        files.wait_quietly()
        raise
    merged: dict[str, TensorEntry] = {}  # several blocks of one tensor: one entry
    for item, c, chunks in pending:
        entry = merged.get(item.name)
        new = tuple(p.chunk() for p in chunks)
        if entry is None:
            merged[item.name] = TensorEntry(item.name, item.shape, "bfloat16", c.name, item.changed,
                                            new, c.version)
        else:
            merged[item.name] = replace(entry, changed=entry.changed + item.changed,
                                        chunks=entry.chunks + new)
    return files, tuple(merged.values())


def write_step(store: Store, loop: BackgroundLoop, facts: StepFacts, items: list[StepItem],
               options: WriteOptions, *, executor: Executor | None = None) -> Manifest:
    """Write the data files of one step, then its manifest. Returns the committed manifest,
    its ``identity`` set from the bytes written.

    Format ``version`` 3 (default) and 2 need ``run_id`` and ``writer`` and write ``base_id``
    (a delta) and ``resumed_from`` (an anchor, optional); 1 writes the old format (no writer
    token, no identities, chunks placed by position); ``facts.adapter``, an adapter bucket's
    record, needs version 2 or 3. The manifest is built, serialized and checked while the last
    data file is still being written; it is committed once every data file is. ``executor``:
    as in ``write_files``.
    """
    return commit_step(store, loop, facts, items, options, executor=executor)[0]


def commit_step(store: Store, loop: BackgroundLoop, facts: StepFacts, items: list[StepItem],
                options: WriteOptions, *, executor: Executor | None = None,
                gate: Future[Any] | None = None) -> tuple[Manifest, int]:
    """``write_step``, returning the manifest and the size of its committed bytes. ``gate``: a
    check run on ``loop`` meanwhile (the publisher's second-writer check) that must pass before
    any file is written; its error is raised and nothing is written."""
    run_id, writer = options.tokens
    if options.version >= 2 and not (run_id and writer):
        raise ConfigError(f"write_step: format version {options.version} needs run_id and writer")
    if facts.adapter is not None and options.version < 2:
        raise ConfigError("write_step: format version 1 has no adapter record; write an adapter "
                          "bucket's steps with version 2 or 3")
    files, entries = _encode_and_pack(store, loop, facts, items, options, None, executor, gate)
    try:
        manifest = _manifest(facts, files, entries, options)
        data = manifest.to_json()
    except BaseException:
        files.wait_quietly()
        raise
    # The manifest (the commit point) appears only once every data file is written and its
    # bytes passed the reader's validation; a store may prepare its write meanwhile (file://:
    # the temporary file written and fsync'ed while this thread checks the bytes).
    checked: Future[None] = Future()
    commit = loop.submit(store.write_after(manifest_path(manifest.step), data,
                                           _all_ready(files, checked)))
    try:
        _check_manifest(manifest, data)
    except BaseException as exc:
        checked.set_exception(exc)
        with contextlib.suppress(BaseException):  # it raises this same error, nothing written
            commit.result(options.timeout_s)
        files.wait_quietly()
        raise
    checked.set_result(None)
    try:
        commit.result(options.timeout_s)
    except TimeoutError:
        commit.cancel()
        raise TimeoutError(f"step {manifest.step}: the commit did not finish within "
                           f"{options.timeout_s} s") from None
    return replace(manifest, identity=manifest_identity(data)), len(data)


def _manifest(facts: StepFacts, files: DataFiles, entries: tuple[TensorEntry, ...],
              options: WriteOptions) -> Manifest:
    """The manifest of a step whose data files are ``files`` (their writes may still run)."""
    run_id, writer = options.tokens
    v2 = options.version >= 2
    return Manifest(
        step=facts.step, kind=facts.kind, base_step=facts.base_step,
        anchor_step=facts.anchor_step, created_at=time.time(), fingerprint=facts.fingerprint,
        files=tuple(files.entries), tensors=entries,
        totals=Totals(facts.totals[0], facts.totals[1], sum(e.changed for e in entries),
                      sum(f.size for f in files.entries)),
        schema_version=options.version, run_id=run_id, writer=writer,
        base_id=facts.base_id if v2 and facts.kind == "delta" else None,
        resumed_from=facts.resumed_from if v2 and facts.kind == "anchor" else None,
        adapter=facts.adapter,
    )


async def _all_ready(files: DataFiles, checked: Future[None]) -> None:
    """Every data file written (their first error raised), then the manifest's check passed."""
    await files.written()
    await asyncio.wrap_future(checked)


def manifest_bytes(manifest: Manifest) -> bytes:
    """The document of ``manifest``, parsed back as a reader parses it: FormatError ("... a
    reader would refuse it") for a manifest a reader would refuse."""
    data = manifest.to_json()
    _check_manifest(manifest, data)
    return data


def _check_manifest(manifest: Manifest, data: bytes) -> None:
    """FormatError ("... a reader would refuse it") where a reader refuses ``data``."""
    try:  # the reader's own validation, on exactly these bytes: never commit what it refuses
        Manifest.from_json(data, source=f"step {manifest.step}'s manifest, not committed")
    except FormatError as exc:
        raise FormatError(f"{exc}; a reader would refuse it") from None


def commit_manifest(store: Store, loop: BackgroundLoop, manifest: Manifest,
                    timeout_s: float) -> Manifest:
    """Write ``manifest`` create-only (the commit point of its step; a committed step is never
    rewritten) and return it with its ``identity``: the digest of exactly the bytes written.
    The bytes are first parsed as a reader parses them (``manifest_bytes``): a manifest a reader
    would refuse is a FormatError here, and nothing is committed."""
    data = manifest_bytes(manifest)
    loop.run(store.write(manifest_path(manifest.step), data), timeout_s)
    return replace(manifest, identity=manifest_identity(data))


__all__ = ["MAX_ENCODE_THREADS", "StepFacts", "StepItem", "WriteOptions", "commit_manifest", "commit_step",
           "encode_threads_for", "manifest_bytes", "retain", "shifted", "write_files", "write_step"]

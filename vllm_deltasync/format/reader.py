"""``BucketReader``: list committed steps, plan chains, download, verify and decode.

Format v1: nothing is decoded from a data file before its size and sha256 match the manifest.
Format v2: the reader range-reads only the byte ranges of the selected tensors' chunks and
checks each chunk's sha256 before decoding it. A missing or altered file raises
:class:`IntegrityError`, a broken chain :class:`ChainError`, a manifest that breaks the
coverage rule (:mod:`~vllm_deltasync.format.coverage`) :class:`FormatError`. The reader never
fills a gap silently; a consumer applies a step's patches only once ``iter_patches`` has
finished without an error (the last checks run at its end).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from vllm_deltasync.errors import ChainError, FormatError, IntegrityError, NotFoundError
from vllm_deltasync.format._listing import newest_readable
from vllm_deltasync.format._selected import read_manifest
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.codecs import decode_chunk
from vllm_deltasync.format.coverage import SparseOrder
from vllm_deltasync.format.layout import MANIFEST_DIR, manifest_path, parse_manifest_path
from vllm_deltasync.format.manifest import (
    MAX_MANIFEST_BYTES,
    Chunk,
    FileEntry,
    Manifest,
    TensorEntry,
)
from vllm_deltasync.format.plan import base_identity, chain_problems, plan_chain, short_id
from vllm_deltasync.format.plan import chain_ranges as _chunk_ranges
from vllm_deltasync.format.plan import fetch_plan as _fetch_plan
from vllm_deltasync.stores import Store, open_store
from vllm_deltasync.stores.mirrors import MirroredStore, MirrorOptions, check_mirror_urls

_MANIFEST_CACHE = 256
_HASH_IN_THREAD_BYTES = 1 << 20
_TORCH_DTYPES = {"BF16": torch.bfloat16, "I16": torch.int16, "I32": torch.int32,
                 "I64": torch.int64, "U8": torch.uint8}


class _ByteBudget:
    """At most ``limit`` bytes in flight; one oversized item may pass alone."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


class BucketReader:
    """Read side of a bucket."""

    def __init__(self, store: Store, *, max_concurrency: int = 8, max_inflight_bytes: int = 1 << 30,
                 fingerprint: str | None = None, decode_threads: int = 0,
                 mirror_urls: str | Sequence[str] = (),
                 mirror_options: MirrorOptions | None = None) -> None:
        """
        Args:
            store: the bucket.
            max_concurrency: data files downloaded at once.
            max_inflight_bytes: bytes of data files downloaded but not yet consumed.
            fingerprint: if set, ``plan`` refuses steps of another parameter set.
            decode_threads: threads verifying and decoding the chunks of a file in parallel
                (sha256, zstd, numpy and torch release the GIL); 0: one per available core, at
                most 8; 1: on the event loop's thread, one chunk after another.
            mirror_urls: HTTP caches tried for data objects before the bucket (a comma-separated
                string or a list of base URLs; ``stores/mirrors.py``): ``store`` is wrapped in a
                :class:`~vllm_deltasync.stores.mirrors.MirroredStore`. Manifests still come from
                the bucket, and every byte is checked against them whoever served it.
            mirror_options: how mirrors are read (timeouts, back-off); None: the defaults.
        """
        if check_mirror_urls(mirror_urls):
            store = MirroredStore(store, mirror_urls, mirror_options)
        self.decode_threads = decode_threads or min(8, _available_cores())
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.thread_init: Callable[[], None] | None = None
        """Runs first on each decode thread (the poller places them on its staging cores)."""
        self.store = store
        self.max_concurrency = max_concurrency
        self.max_inflight_bytes = max_inflight_bytes
        self.fingerprint = fingerprint
        self._manifests: OrderedDict[int, Manifest] = OrderedDict()
        self.remember_failures_s = 0.0
        """A manifest refused as malformed is refused again from memory, without a download,
        for this many seconds (0: read it again every time). The poller sets it."""
        self._failed: dict[int, tuple[float, str, type[FormatError]]] = {}
        self.select: Callable[[str], bool] | None = None
        """The tensors this reader's user reads (the ``select`` it gives ``iter_patches``, a
        rank's shard map), None: all. Manifests are then parsed and checked for these tensors
        only, besides the step-wide rules, and list only these (format/_selected.py). Set it
        before the first read: cached manifests are not read again."""

    @classmethod
    def open(cls, url: str, *, store_options: Mapping[str, Any] | None = None, **kw: Any) -> BucketReader:
        return cls(open_store(url, **dict(store_options or {})), **kw)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        await self.store.close()

    async def _decode_all(self, m: Manifest, pairs: list[tuple[TensorEntry, Chunk]],
                          get: Callable[[int, int], memoryview]) -> list[TensorPatch]:
        """Verify and decode ``pairs`` (chunks of one file), on the decode threads."""
        if self.decode_threads <= 1 or len(pairs) < 2:
            return [self._chunk_patch(m, e, c, get) for e, c in pairs]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.decode_threads, thread_name_prefix="deltasync-decode",
                initializer=self.thread_init)
        loop = asyncio.get_running_loop()
        return list(await asyncio.gather(*(
            loop.run_in_executor(self._pool, self._chunk_patch, m, e, c, get)
            for e, c in pairs)))

    async def __aenter__(self) -> BucketReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ discovery
    async def list_steps(self, after: int | None = None) -> list[int]:
        """Committed steps, ascending (only those after ``after`` if given)."""
        steps = [parse_manifest_path(o.path) for o in await self.store.list(f"{MANIFEST_DIR}/")]
        return sorted(s for s in steps if s is not None and (after is None or s > after))

    async def latest_step(self) -> int | None:
        """The newest committed step whose manifest reads: an unreadable one (garbage under a
        step's name, another step's manifest) is skipped with one warning line naming it
        (format/_listing.py), never taken as the newest step."""
        newest = await newest_readable(self, await self.list_steps())
        return None if newest is None else newest[0]

    async def manifest(self, step: int, *, fresh: bool = False) -> Manifest:
        """The manifest of ``step`` (cached; ``fresh``: read from the bucket again, replacing
        the cached one). NotFoundError if not committed, FormatError if bad."""
        cached = None if fresh else self._manifests.get(step)
        if cached is not None:
            self._manifests.move_to_end(step)
            return cached
        failed = self._failed.get(step)
        if failed is not None and time.monotonic() < failed[0]:
            raise failed[2](f"{failed[1]} (remembered; not downloaded again)")
        path = manifest_path(step)
        source = f"{self.store.url}/{path}"
        try:
            data = await self.store.read(path, max_bytes=MAX_MANIFEST_BYTES)
            m = read_manifest(data, source=source, select=self.select)
            if m.step != step:
                raise FormatError(f"{source}: holds step {m.step}, its name says {step}")
        except FormatError as exc:
            if self.remember_failures_s > 0:
                self._failed[step] = (time.monotonic() + self.remember_failures_s, str(exc),
                                      type(exc))
            exc.add_note(f"step={step}")
            raise
        self._failed.pop(step, None)
        self._manifests[step] = m
        if len(self._manifests) > _MANIFEST_CACHE:
            self._manifests.popitem(last=False)
        return m

    def forget(self) -> None:
        """Drop every cached manifest and remembered failure: the bucket's history changed
        (a branch change), so step numbers may now name other manifests."""
        self._manifests.clear()
        self._failed.clear()

    # ------------------------------------------------------------------ chains
    async def plan(self, applied: Manifest | int | None, target: int | None = None, *,
                   max_chain: int = 64) -> list[Manifest]:
        """Manifests to apply in order to go from ``applied`` to ``target`` (newest if None).

        ``applied`` is the manifest the weights hold (identity-aware: docs/format.md §9), a
        bare step number (tools that hold no weights), or None (unknown weights). Deltas
        chaining from ``applied`` when it is on ``target``'s chain within ``max_chain`` steps
        (the same identity, not only the same number); otherwise ``[anchor, deltas...]`` from
        the anchor of ``target``'s chain. ``[]`` when up to date. ChainError when no complete
        chain reaches ``target``. (format/plan.py)
        """
        return await plan_chain(self, applied, target, max_chain=max_chain)

    async def base_identity(self, m: Manifest) -> str | None:
        """The identity of the manifest delta ``m`` was computed from (format/plan.py)."""
        return await base_identity(self, m)

    # ------------------------------------------------------------------ data
    async def fetch_file(self, m: Manifest, index: int) -> dict[str, torch.Tensor]:
        """Download data file ``index`` of ``m``, verify size and sha256, then parse it."""
        entry = m.files[index]
        return _load(m, entry, await self._verified_bytes(m, entry))

    async def _verified_bytes(self, m: Manifest, entry: FileEntry) -> bytes:
        """The file's bytes, size and sha256 checked. Bytes that fail are evicted from the
        store's cache (a node cache) when it held them, and read once more from the bucket."""
        try:
            return await self._checked_bytes(m, entry)
        except IntegrityError:
            if not await self.store.evict(entry.path):
                raise
        return await self._checked_bytes(m, entry)

    async def _checked_bytes(self, m: Manifest, entry: FileEntry) -> bytes:
        try:
            data = await self.store.read(entry.path)
        except NotFoundError as exc:
            raise IntegrityError(
                f"step {m.step}: data file {entry.path} listed in its manifest is missing"
            ) from exc
        if len(data) != entry.size:
            raise IntegrityError(
                f"step {m.step}: data file {entry.path} is {len(data)} bytes, its manifest says {entry.size}"
            )
        if len(data) >= _HASH_IN_THREAD_BYTES:
            digest = await asyncio.to_thread(_sha256, data)
        else:
            digest = _sha256(data)
        if digest != entry.sha256:
            raise IntegrityError(
                f"step {m.step}: data file {entry.path} has sha256 {digest[:16]}..., its manifest "
                f"says {entry.sha256[:16]}...; the file is corrupt"
            )
        return data

    async def iter_patches(self, m: Manifest, *,
                           select: Callable[[str], bool] | None = None) -> AsyncIterator[TensorPatch]:
        """Patches of the selected tensors of ``m``, file by file as downloads complete.

        v1: whole data files, each verified (size, sha256) before decoding. v2: a file whose
        chunks are all selected is read whole and verified like v1; of any other file only the
        byte ranges of the selected chunks are read. Every v2 chunk is verified by its own
        sha256 before it is decoded.
        """
        by_file, whole, cost = _fetch_plan(m, select)
        budget = _ByteBudget(self.max_inflight_bytes)
        slots = asyncio.Semaphore(self.max_concurrency)
        order = SparseOrder(m)

        async def fetch(index: int) -> tuple[int, list[TensorPatch]]:
            await budget.acquire(cost[index])
            try:
                async with slots:
                    if m.schema_version == 1:
                        return index, self._decode_file(m, index, await self.fetch_file(m, index),
                                                        by_file[index])
                    if whole[index]:
                        view = memoryview(await self._verified_bytes(m, m.files[index]))
                        return index, await self._decode_all(
                            m, by_file[index], lambda o, n: view[o : o + n])
                    return index, await self._fetch_chunks(m, index, by_file[index])
            except BaseException:
                await budget.release(cost[index])
                raise

        tasks = [asyncio.ensure_future(fetch(i)) for i in sorted(by_file)]
        try:
            for next_done in asyncio.as_completed(tasks):
                index, patches = await next_done
                await budget.release(cost[index])
                for (_, chunk), patch in zip(by_file[index], patches, strict=True):
                    order.add(chunk.start, patch)
                for patch in patches:
                    yield patch
            order.check()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def selected_bytes(m: Manifest, select: Callable[[str], bool] | None = None) -> int:
        """Bytes :meth:`iter_patches` reads from the bucket for the tensors ``select`` keeps."""
        return sum(_fetch_plan(m, select)[2].values())

    def _decode_file(self, m: Manifest, index: int, tensors: Mapping[str, torch.Tensor],
                     pairs: list[tuple[TensorEntry, Chunk]]) -> list[TensorPatch]:
        source = f"step {m.step}: {m.files[index].path}"
        return [decode_chunk(e, c, tensors, source=source) for e, c in pairs]

    async def _fetch_chunks(self, m: Manifest, index: int,
                            pairs: list[tuple[TensorEntry, Chunk]]) -> list[TensorPatch]:
        """v2: range-read the chunks' bytes (adjacent ranges merged), verify, decode. Bytes that
        fail a check are evicted from the store's cache when it held them, and read once more."""
        try:
            return await self._fetch_chunks_once(m, index, pairs)
        except IntegrityError:
            if not await self.store.evict(m.files[index].path):
                raise
        return await self._fetch_chunks_once(m, index, pairs)

    async def _fetch_chunks_once(self, m: Manifest, index: int,
                                 pairs: list[tuple[TensorEntry, Chunk]]) -> list[TensorPatch]:
        entry = m.files[index]
        parts: list[tuple[int, bytes]] = []
        for offset, length in _chunk_ranges(pairs):
            try:
                data = await self.store.read(entry.path, offset, offset + length)
            except NotFoundError as exc:
                raise IntegrityError(
                    f"step {m.step}: data file {entry.path} listed in its manifest is missing"
                ) from exc
            if len(data) != length:
                raise IntegrityError(f"step {m.step}: data file {entry.path}: bytes [{offset}, "
                                     f"{offset + length}) came back as {len(data)} bytes; the file is truncated")
            parts.append((offset, data))

        def get(offset: int, length: int) -> memoryview:
            for start, data in parts:
                if start <= offset and offset + length <= start + len(data):
                    return memoryview(data)[offset - start : offset - start + length]
            raise AssertionError("a chunk range outside the fetched ranges")  # pragma: no cover

        return await self._decode_all(m, pairs, get)

    def _chunk_patch(self, m: Manifest, entry: TensorEntry, chunk: Chunk,
                     get: Callable[[int, int], memoryview]) -> TensorPatch:
        """v2: check the chunk's sha256 over its role bytes, then decode it."""
        assert chunk.roles is not None
        path = m.files[chunk.file].path
        digest = hashlib.sha256()
        views = {}
        for role in sorted(chunk.roles):
            r = chunk.roles[role]
            views[role] = get(r.offset, r.length)
            digest.update(views[role])
        if digest.hexdigest() != chunk.sha256:
            raise IntegrityError(
                f"step {m.step}: tensor {entry.name!r}: a chunk in {path} has sha256 "
                f"{digest.hexdigest()[:16]}..., its manifest says {(chunk.sha256 or '')[:16]}...; "
                "the data is corrupt"
            )
        tensors = {}
        for role, view in views.items():
            r = chunk.roles[role]
            dtype = _TORCH_DTYPES[r.dtype]
            if r.length % dtype.itemsize:
                raise FormatError(f"step {m.step}: tensor {entry.name!r}: role {role!r} is "
                                  f"{r.length} bytes, not a whole number of {r.dtype}")
            tensors[r.key] = (torch.frombuffer(bytearray(view), dtype=dtype) if r.length
                              else torch.empty(0, dtype=dtype))
        return decode_chunk(entry, chunk, tensors, source=f"step {m.step}: {path}")

    async def read_full(self, step: int | None = None) -> dict[str, torch.Tensor]:
        """Every tensor of ``step`` (newest if None) rebuilt from its anchor and deltas."""
        chain = await self.plan(None, step)
        if not chain:
            raise ChainError(f"{self.store.url} holds no committed step")
        anchor = chain[0]
        state = {e.name: torch.empty(e.numel, dtype=torch.bfloat16) for e in anchor.tensors}
        async for patch in self.iter_patches(anchor):
            patch.apply_to(state[patch.name])
        for m in chain[1:]:
            for entry in m.tensors:
                base = state.get(entry.name)
                if base is None or anchor.tensor(entry.name).shape != entry.shape:  # type: ignore[union-attr]
                    raise ChainError(f"step {m.step}: tensor {entry.name!r} {list(entry.shape)} is "
                                     f"not in anchor {anchor.step} with that shape")
            async for patch in self.iter_patches(m):
                patch.apply_to(state[patch.name])
        return {e.name: state[e.name].view(e.shape) for e in anchor.tensors}

    # ------------------------------------------------------------------ whole-bucket check
    async def verify(self) -> list[str]:
        """Check every manifest, file and chain link; one line per problem ([] when all holds)."""
        problems: list[str] = []
        manifests: dict[int, Manifest] = {}
        for step in await self.list_steps():
            try:
                manifests[step] = await self.manifest(step)
            except (FormatError, NotFoundError) as exc:
                problems.append(str(exc))
        slots = asyncio.Semaphore(self.max_concurrency)

        async def check(m: Manifest, index: int) -> list[str | tuple[int, int, int, TensorPatch]]:
            pairs = [(e, c) for e in m.tensors for c in e.chunks if c.file == index]
            async with slots:
                try:
                    data = await self._verified_bytes(m, m.files[index])
                    if m.schema_version == 1:
                        return [(m.step, index, c.start, p) for (_, c), p in zip(
                            pairs, self._decode_file(m, index, _load(m, m.files[index], data), pairs),
                            strict=True)]
                    view = memoryview(data)
                    return [(m.step, index, c.start,
                             self._chunk_patch(m, e, c, lambda o, n: view[o : o + n]))
                            for e, c in pairs]
                except FormatError as exc:
                    return [str(exc)]

        results = await asyncio.gather(*(check(m, i) for m in manifests.values()
                                         for i in range(len(m.files))))
        orders = {step: SparseOrder(m) for step, m in manifests.items()}
        for result in results:
            for item in result:
                if isinstance(item, str):
                    problems.append(item)
                else:
                    step, _, start, patch = item
                    orders[step].add(start, patch)
        for m in manifests.values():
            try:
                orders[m.step].check()
            except FormatError as exc:
                problems.append(str(exc))
            problems += chain_problems(m, manifests)
        return problems


def _load(m: Manifest, entry: FileEntry, data: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(data)
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise FormatError(f"step {m.step}: {entry.path} is not a safetensors file ({exc})") from exc


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


__all__ = ["BucketReader", "short_id"]

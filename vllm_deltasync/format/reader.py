"""``BucketReader``: list committed steps, plan chains, download, verify and decode.

Nothing is decoded from a data file before its size and sha256 match the manifest; a
missing or altered file raises :class:`IntegrityError`, a broken chain :class:`ChainError`.
The reader never fills a gap silently.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from vllm_deltasync.errors import (
    ChainError,
    FingerprintError,
    FormatError,
    IntegrityError,
    NotFoundError,
)
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.codecs import decode_chunk
from vllm_deltasync.format.layout import MANIFEST_DIR, manifest_path, parse_manifest_path
from vllm_deltasync.format.manifest import Chunk, FileEntry, Manifest, TensorEntry
from vllm_deltasync.stores import Store, open_store

_MANIFEST_CACHE = 256
_HASH_IN_THREAD_BYTES = 1 << 20


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


class BucketReader:
    """Read side of a bucket."""

    def __init__(self, store: Store, *, max_concurrency: int = 8, max_inflight_bytes: int = 1 << 30,
                 fingerprint: str | None = None) -> None:
        """
        Args:
            store: the bucket.
            max_concurrency: data files downloaded at once.
            max_inflight_bytes: bytes of data files downloaded but not yet consumed.
            fingerprint: if set, ``plan`` refuses steps of another parameter set.
        """
        self.store = store
        self.max_concurrency = max_concurrency
        self.max_inflight_bytes = max_inflight_bytes
        self.fingerprint = fingerprint
        self._manifests: OrderedDict[int, Manifest] = OrderedDict()

    @classmethod
    def open(cls, url: str, *, store_options: Mapping[str, Any] | None = None, **kw: Any) -> BucketReader:
        return cls(open_store(url, **dict(store_options or {})), **kw)

    async def close(self) -> None:
        await self.store.close()

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
        steps = await self.list_steps()
        return steps[-1] if steps else None

    async def manifest(self, step: int) -> Manifest:
        """The manifest of ``step`` (cached). NotFoundError if not committed, FormatError if bad."""
        cached = self._manifests.get(step)
        if cached is not None:
            self._manifests.move_to_end(step)
            return cached
        path = manifest_path(step)
        source = f"{self.store.url}/{path}"
        m = Manifest.from_json(await self.store.read(path), source=source)
        if m.step != step:
            raise FormatError(f"{source}: holds step {m.step}, its name says {step}")
        self._manifests[step] = m
        if len(self._manifests) > _MANIFEST_CACHE:
            self._manifests.popitem(last=False)
        return m

    # ------------------------------------------------------------------ chains
    async def plan(self, applied: int | None, target: int | None = None, *,
                   max_chain: int = 64) -> list[Manifest]:
        """Manifests to apply in order to go from ``applied`` to ``target`` (newest if None).

        Deltas chaining from ``applied`` when it is on ``target``'s chain within ``max_chain``
        steps; otherwise ``[anchor, deltas...]`` from the anchor of ``target``'s chain.
        ``[]`` when up to date. ChainError when no complete chain reaches ``target``.
        """
        if target is None:
            target = await self.latest_step()
            if target is None:
                return []
        if applied == target:
            return []
        try:
            chain = [await self.manifest(target)]
        except NotFoundError:
            raise ChainError(f"step {target} is not committed in {self.store.url}") from None
        self._check_fingerprint(chain[0])
        while chain[-1].kind == "delta":
            if chain[-1].base_step == applied and len(chain) <= max_chain:
                break
            chain.append(await self._base_of(chain[-1]))
        return chain[::-1]

    def _check_fingerprint(self, m: Manifest) -> None:
        if self.fingerprint is not None and m.fingerprint != self.fingerprint:
            raise FingerprintError(
                f"step {m.step} of {self.store.url} was written for another parameter set "
                f"({m.fingerprint}, expected {self.fingerprint}); point this reader at the "
                "bucket of this model"
            )

    async def _base_of(self, m: Manifest) -> Manifest:
        """The manifest ``m`` applies on, checked to belong to the same chain."""
        assert m.base_step is not None  # a delta always has one (checked by the parser)
        try:
            base = await self.manifest(m.base_step)
        except NotFoundError:
            raise ChainError(
                f"step {m.step}: its base step {m.base_step} is missing from {self.store.url}, so no "
                f"complete chain from anchor {m.anchor_step} reaches it; wait for the next anchor"
            ) from None
        if base.anchor_step != m.anchor_step:
            raise ChainError(
                f"step {m.step} says its chain starts at anchor {m.anchor_step}, but its base "
                f"step {base.step} belongs to anchor {base.anchor_step}"
            )
        if base.fingerprint != m.fingerprint:
            raise FingerprintError(
                f"step {m.step} and its base step {base.step} have different fingerprints; the "
                "bucket mixes two parameter sets"
            )
        return base

    # ------------------------------------------------------------------ data
    async def fetch_file(self, m: Manifest, index: int) -> dict[str, torch.Tensor]:
        """Download data file ``index`` of ``m``, verify size and sha256, then parse it."""
        entry = m.files[index]
        data = await self._verified_bytes(m, entry)
        try:
            return load_safetensors(data)
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise FormatError(f"step {m.step}: {entry.path} is not a safetensors file ({exc})") from exc

    async def _verified_bytes(self, m: Manifest, entry: FileEntry) -> bytes:
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
        """Patches of the selected tensors of ``m``, file by file as downloads complete."""
        by_file: dict[int, list[tuple[TensorEntry, Chunk]]] = {}
        for entry in m.tensors:
            if select is None or select(entry.name):
                for chunk in entry.chunks:
                    by_file.setdefault(chunk.file, []).append((entry, chunk))
        budget = _ByteBudget(self.max_inflight_bytes)
        slots = asyncio.Semaphore(self.max_concurrency)

        async def fetch(index: int) -> tuple[int, dict[str, torch.Tensor]]:
            await budget.acquire(m.files[index].size)
            try:
                async with slots:
                    return index, await self.fetch_file(m, index)
            except BaseException:
                await budget.release(m.files[index].size)
                raise

        tasks = [asyncio.ensure_future(fetch(i)) for i in sorted(by_file)]
        try:
            for next_done in asyncio.as_completed(tasks):
                index, tensors = await next_done
                source = f"step {m.step}: {m.files[index].path}"
                patches = [decode_chunk(e, c, tensors, source=source) for e, c in by_file[index]]
                del tensors
                await budget.release(m.files[index].size)
                for patch in patches:
                    yield patch
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def read_full(self, step: int | None = None) -> dict[str, torch.Tensor]:
        """Every tensor of ``step`` (newest if None) rebuilt from its anchor and deltas."""
        chain = await self.plan(None, step)
        if not chain:
            raise ChainError(f"{self.store.url} holds no committed step")
        anchor = chain[0]
        state = {e.name: torch.empty(e.numel, dtype=torch.bfloat16) for e in anchor.tensors}
        _check_anchor(anchor)
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

        async def check(m: Manifest, entry: FileEntry) -> str | None:
            async with slots:
                try:
                    await self._verified_bytes(m, entry)
                except IntegrityError as exc:
                    return str(exc)
            return None

        checks = [check(m, f) for m in manifests.values() for f in m.files]
        problems += [p for p in await asyncio.gather(*checks) if p]
        for m in manifests.values():
            problems += _chain_problems(m, manifests)
            if m.kind == "anchor":
                try:
                    _check_anchor(m)
                except FormatError as exc:
                    problems.append(str(exc))
        return problems


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_anchor(m: Manifest) -> None:
    """Each tensor of an anchor is dense and its chunks tile it exactly, in order."""
    if len(m.tensors) != m.totals.tensors:
        raise FormatError(f"anchor {m.step} lists {len(m.tensors)} tensors, its totals say {m.totals.tensors}")
    for entry in m.tensors:
        position = 0
        for chunk in entry.chunks:
            if chunk.start != position:
                raise FormatError(f"anchor {m.step}: tensor {entry.name!r} has a gap or overlap at {position}")
            position = chunk.stop
        if entry.encoding != "dense" or position != entry.numel:
            raise FormatError(f"anchor {m.step}: tensor {entry.name!r} does not cover its {entry.numel} elements densely")


def _chain_problems(m: Manifest, manifests: Mapping[int, Manifest]) -> list[str]:
    if m.kind == "anchor":
        return []
    base = manifests.get(m.base_step)  # type: ignore[arg-type]
    if base is None:
        return [f"step {m.step}: base step {m.base_step} is missing; the chain from anchor "
                f"{m.anchor_step} is broken"]
    problems = []
    if base.anchor_step != m.anchor_step:
        problems.append(f"step {m.step}: chain says anchor {m.anchor_step}, base step {base.step} says {base.anchor_step}")
    if base.fingerprint != m.fingerprint:
        problems.append(f"step {m.step}: fingerprint differs from its base step {base.step}")
    walk = base
    while walk.kind == "delta" and walk.base_step in manifests:
        walk = manifests[walk.base_step]  # type: ignore[index]
    if walk.kind == "delta":
        problems.append(f"step {m.step}: cannot be rebuilt, its chain misses step {walk.base_step}")
    return problems


__all__ = ["BucketReader"]

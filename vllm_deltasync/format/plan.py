"""Chain planning and chunk selection: what a reader fetches to go from the step its weights
hold to a target step.

``plan_chain`` walks back from the target by identity (docs/format.md §9: a delta applies only
onto the manifest its ``base_id`` names) and checks the chain rules across every link (anchor,
run, fingerprint); ``chain_problems`` is the same check over a whole bucket for ``verify``;
``fetch_plan`` picks a step's chunks for the tensors a reader selects and the bytes it reads.
The manifests come from a :class:`ManifestSource` (the :class:`~.reader.BucketReader`), which
reads, caches and checks them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from vllm_deltasync.errors import ChainError, FingerprintError, NotFoundError
from vllm_deltasync.format.manifest import Chunk, Manifest, TensorEntry, merge_ranges
from vllm_deltasync.stores import Store

Pairs = list[tuple[TensorEntry, Chunk]]
"""The (tensor, chunk) pairs read from one data file."""


class ManifestSource(Protocol):
    """What planning reads: the bucket's manifests (cached unless ``fresh``)."""

    store: Store
    fingerprint: str | None

    async def manifest(self, step: int, *, fresh: bool = False) -> Manifest: ...

    async def latest_step(self) -> int | None: ...


def short_id(identity: str | None) -> str:
    """A step identity for messages: ``sha256:1a2b3c4d5e6f`` (None: ``unknown``)."""
    return identity[:19] if identity else "unknown"


async def plan_chain(source: ManifestSource, applied: Manifest | int | None,
                     target: int | None, *, max_chain: int) -> list[Manifest]:
    """:meth:`~.reader.BucketReader.plan`: the manifests from ``applied`` to ``target``."""
    at = applied.step if isinstance(applied, Manifest) else applied
    if target is None:
        target = await source.latest_step()
        if target is None:
            return []
    try:
        chain = [await source.manifest(target)]
    except NotFoundError:
        raise ChainError(f"step {target} is not committed in {source.store.url}") from None
    if at == target and (not isinstance(applied, Manifest) or applied.identity is None
                         or chain[0].identity == applied.identity):
        return []
    check_fingerprint(source, chain[0])
    while chain[-1].kind == "delta":
        if (chain[-1].base_step == at and len(chain) <= max_chain
                and await _continues(source, chain[-1], applied)):
            break
        chain.append(await _base_of(source, chain[-1]))
    return chain[::-1]


async def _continues(source: ManifestSource, m: Manifest, applied: Manifest | int | None) -> bool:
    """Delta ``m`` applies onto exactly ``applied`` (its base step number): the identity
    ``m`` names (format v2+ since 0.5.0), else that of its base manifest read from the
    bucket now, equals the applied one; the chain rules hold across the link."""
    if not isinstance(applied, Manifest) or applied.identity is None:
        return True  # a bare number: the caller holds no weights to protect
    if await base_identity(source, m) != applied.identity:
        return False
    check_link(m, applied)
    return True


async def base_identity(source: ManifestSource, m: Manifest) -> str | None:
    """The identity of the manifest delta ``m`` was computed from: the ``base_id`` it
    names, or (format 1 and deltas written before 0.5.0) the digest of its base manifest
    as the bucket holds it now, read again (never from the cache), so a rewritten base is
    seen. None for an anchor."""
    if m.kind != "delta" or m.base_step is None:
        return None
    if m.base_id is not None:
        return m.base_id
    try:
        return (await source.manifest(m.base_step, fresh=True)).identity
    except NotFoundError:
        raise ChainError(f"step {m.step}: its base step {m.base_step} is missing from "
                         f"{source.store.url}; wait for the next anchor") from None


def check_fingerprint(source: ManifestSource, m: Manifest) -> None:
    """FingerprintError when ``source`` follows one parameter set and ``m`` is of another."""
    if source.fingerprint is not None and m.fingerprint != source.fingerprint:
        raise FingerprintError(
            f"step {m.step} of {source.store.url} was written for another parameter set "
            f"({m.fingerprint}, expected {source.fingerprint}); point this reader at the "
            "bucket of this model"
        )


async def _base_of(source: ManifestSource, m: Manifest) -> Manifest:
    """The manifest ``m`` applies on, checked to belong to the same chain."""
    assert m.base_step is not None  # a delta always has one (checked by the parser)
    url = source.store.url
    try:
        base = await source.manifest(m.base_step)
        if m.base_id is not None and base.identity != m.base_id:
            base = await source.manifest(m.base_step, fresh=True)  # the cached one is stale?
    except NotFoundError:
        raise ChainError(
            f"step {m.step}: its base step {m.base_step} is missing from {url}, so no "
            f"complete chain from anchor {m.anchor_step} reaches it; wait for the next anchor"
        ) from None
    if m.base_id is not None and base.identity != m.base_id:
        raise ChainError(
            f"step {m.step} was computed from a step {m.base_step} ({short_id(m.base_id)}) "
            f"that is not the step {m.base_step} in {url} now "
            f"({short_id(base.identity)}): the chain was rewritten (a trainer restart, a "
            "second writer); it is never applied, wait for the next anchor"
        )
    check_link(m, base)
    return base


def check_link(m: Manifest, base: Manifest) -> None:
    """The chain rules between delta ``m`` and the manifest it applies on (§9)."""
    if base.anchor_step != m.anchor_step:
        raise ChainError(
            f"step {m.step} says its chain starts at anchor {m.anchor_step}, but its base "
            f"step {base.step} belongs to anchor {base.anchor_step}"
        )
    if base.run_id != m.run_id:
        raise ChainError(
            f"step {m.step} (run {m.run_id}) is based on step {base.step} of run "
            f"{base.run_id}; a delta chain never crosses runs, wait for the next anchor"
        )
    if base.fingerprint != m.fingerprint:
        raise FingerprintError(
            f"step {m.step} and its base step {base.step} have different fingerprints; the "
            "bucket mixes two parameter sets"
        )


def chain_ranges(pairs: Pairs) -> tuple[tuple[int, int], ...]:
    """The merged ``(offset, length)`` byte ranges of ``pairs``' chunks (v2)."""
    return merge_ranges((r.offset, r.length) for _, c in pairs for r in (c.roles or {}).values())


def fetch_plan(m: Manifest, select: Callable[[str], bool] | None) -> tuple[
        dict[int, Pairs], dict[int, bool], dict[int, int]]:
    """What :meth:`~.reader.BucketReader.iter_patches` reads: the selected (tensor, chunk)
    pairs per data file, whether each file is read whole (v1, or all its chunks wanted; never
    a file without an index: a manifest read for some tensors only, format/_selected.py) and
    the bytes read. ``select`` is asked once per tensor."""
    by_file: dict[int, Pairs] = {}
    chunks_in: dict[int, int] = {}
    for entry in m.tensors:
        wanted = select is None or select(entry.name)
        for chunk in entry.chunks:
            chunks_in[chunk.file] = chunks_in.get(chunk.file, 0) + 1
            if wanted:
                by_file.setdefault(chunk.file, []).append((entry, chunk))
    whole = {i: m.schema_version == 1 or (m.files[i].index is not None and len(pairs) == chunks_in[i])
             for i, pairs in by_file.items()}
    cost = {i: m.files[i].size if whole[i] else sum(n for _, n in chain_ranges(pairs))
            for i, pairs in by_file.items()}
    return by_file, whole, cost


def chain_problems(m: Manifest, manifests: Mapping[int, Manifest]) -> list[str]:
    """The chain rules of ``m`` against the bucket's other manifests, one line per problem
    (``verify``): its base is there and the same identity, anchor, run and fingerprint; its
    chain reaches an anchor holding every tensor it patches, with the same shape."""
    if m.kind == "anchor":
        return []
    base = manifests.get(m.base_step)  # type: ignore[arg-type]
    if base is None:
        return [f"step {m.step}: base step {m.base_step} is missing; the chain from anchor "
                f"{m.anchor_step} is broken"]
    problems = _link_problems(m, base)
    walk = base
    while walk.kind == "delta" and walk.base_step in manifests:
        walk = manifests[walk.base_step]  # type: ignore[index]
    if walk.kind == "delta":
        problems.append(f"step {m.step}: cannot be rebuilt, its chain misses step {walk.base_step}")
        return problems
    shapes = {e.name: e.shape for e in walk.tensors}  # the anchor: every tensor a delta may patch
    for entry in m.tensors:
        if entry.name not in shapes:
            problems.append(f"step {m.step}: tensor {entry.name!r} is not in its anchor step "
                            f"{walk.step}; the delta cannot be applied (the chain mixes models)")
        elif shapes[entry.name] != entry.shape:
            problems.append(f"step {m.step}: tensor {entry.name!r} is {list(entry.shape)}, in its "
                            f"anchor step {walk.step} {list(shapes[entry.name])}; the delta cannot "
                            "be applied")
    return problems


def _link_problems(m: Manifest, base: Manifest) -> list[str]:
    problems = []
    if m.base_id is not None and base.identity is not None and m.base_id != base.identity:
        problems.append(f"step {m.step}: names base {short_id(m.base_id)}, but step {base.step} "
                        f"in the bucket is {short_id(base.identity)}; the chain was rewritten "
                        "(a second writer, or a trainer restart that reused step numbers)")
    if base.anchor_step != m.anchor_step:
        problems.append(f"step {m.step}: chain says anchor {m.anchor_step}, base step {base.step} says {base.anchor_step}")
    if base.run_id != m.run_id:
        problems.append(f"step {m.step}: run {m.run_id}, its base step {base.step} is of run "
                        f"{base.run_id}; a chain never crosses runs")
    if base.fingerprint != m.fingerprint:
        problems.append(f"step {m.step}: fingerprint differs from its base step {base.step}")
    return problems


__all__ = [
    "ManifestSource",
    "base_identity",
    "chain_problems",
    "chain_ranges",
    "check_fingerprint",
    "check_link",
    "fetch_plan",
    "plan_chain",
    "short_id",
]

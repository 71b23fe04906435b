"""The newest committed step that can be read: a bad newest entry is skipped, not obeyed.

One garbage ``manifests/999999999999.json`` (not JSON, a format this release does not read, or
the manifest of another step under that name) must not become "the newest step" that every
publisher refuses to publish under and every reader fails on. :func:`newest_readable` walks
back from the newest listed step, skipping manifests that do not parse (or hold another step
than their name) with one warning line naming each skipped path, and returns the newest one
that reads. It takes a :class:`~vllm_deltasync.stores.base.Store` (the publisher) or a
``BucketReader`` (the CLI, a reader's ``latest_step``: then the reader's own checks and cache
apply). Store failures (unreachable, refused) are not skipped: they propagate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from vllm_deltasync.errors import FormatError, NotFoundError
from vllm_deltasync.format.layout import MANIFEST_DIR, manifest_path, parse_manifest_path
from vllm_deltasync.format.manifest import MAX_MANIFEST_BYTES, Manifest
from vllm_deltasync.stores.base import Store

if TYPE_CHECKING:
    from vllm_deltasync.format.reader import BucketReader

log = logging.getLogger("vllm_deltasync.format")

MAX_SKIPPED = 16
"""Unreadable manifests skipped at most, newest first, before giving up with a FormatError
(each one may cost a read of up to the manifest size limit)."""


async def committed_steps(store: Store) -> list[int]:
    """Steps with a manifest in ``store``, ascending (one listing of ``manifests/``)."""
    steps = [parse_manifest_path(o.path) for o in await store.list(f"{MANIFEST_DIR}/")]
    return sorted(s for s in steps if s is not None)


async def read_manifest(source: Store | BucketReader, step: int) -> Manifest:
    """The manifest of ``step``: FormatError if it does not parse or holds another step,
    NotFoundError if absent. A ``BucketReader`` reads through its cache and its own checks."""
    if not isinstance(source, Store):
        return await source.manifest(step)
    path = manifest_path(step)
    data = await source.read(path, max_bytes=MAX_MANIFEST_BYTES)  # FormatError past the cap
    m = Manifest.from_json(data, source=f"{source.url}/{path}")
    if m.step != step:
        raise FormatError(f"{source.url}/{path}: holds step {m.step}, its name says {step}")
    return m


def skipped_line(source: Store | BucketReader, step: int, exc: BaseException) -> str:
    """The one warning line of a skipped manifest: its path and why."""
    store = source if isinstance(source, Store) else source.store
    where = f"{store.url}/{manifest_path(step)}"
    why = " ".join(str(exc).split())
    if why.startswith(where):
        why = why[len(where):].lstrip(": ")
    return (f"{where}: skipped, not a readable manifest ({why[:300]}); the newest readable "
            "step before it is used")


async def newest_readable(source: Store | BucketReader, steps: Sequence[int] | None = None, *,
                          max_skipped: int = MAX_SKIPPED,
                          warn: Callable[[str], None] | None = None,
                          ) -> tuple[int, Manifest] | None:
    """``(step, manifest)`` of the newest readable step of ``steps`` (default: every committed
    step), or None when there is none.

    Walking back from the newest, a manifest that does not parse or validate, holds another
    step than its name, or vanished since the listing is skipped with one warning line naming
    its path (``warn``, default: this module's logger). More than ``max_skipped`` unreadable
    manifests in a row raise a FormatError naming the newest of them.
    """
    if steps is None:
        store = source if isinstance(source, Store) else source.store
        steps = await committed_steps(store)
    report = warn or log.warning
    skipped: list[int] = []
    for step in sorted(steps, reverse=True):
        try:
            return step, await read_manifest(source, step)
        except (FormatError, NotFoundError) as exc:
            report(skipped_line(source, step, exc))
            skipped.append(step)
        if len(skipped) > max_skipped:
            store = source if isinstance(source, Store) else source.store
            raise FormatError(
                f"{store.url}: the newest {len(skipped)} manifests do not read (newest "
                f"{manifest_path(skipped[0])}); remove the bad ones or use a new prefix")
    return None


__all__ = ["MAX_SKIPPED", "committed_steps", "newest_readable", "read_manifest", "skipped_line"]

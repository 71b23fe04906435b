"""Retention: what a writer deletes from its bucket after each anchor (docs/format.md §10)."""

from __future__ import annotations

from collections.abc import MutableMapping

from vllm_deltasync.errors import FormatError, NotFoundError
from vllm_deltasync.format.layout import (
    data_dir,
    parse_data_path,
    parse_manifest_path,
    token_writer,
)
from vllm_deltasync.format.manifest import Manifest
from vllm_deltasync.stores import Store


async def retain(store: Store, keep_anchors: int,
                 known: MutableMapping[int, tuple[str, frozenset[str], str | None]], *,
                 writer: str | None = None) -> list[str]:
    """Delete this writer's steps older than its ``keep_anchors``-th newest anchor, and its orphans.

    Ownership (docs/format.md §10): a manifest belongs to its ``writer`` token, or is v1
    (anonymous, writer None); a data folder belongs to the writer token in its name
    (``token_writer``), or is v1 (a token without a writer). ``writer``: this writer's token
    (format v2, v3). Only manifests and data folders carrying it are deleted, plus v1
    (anonymous) steps older than the cutoff. ``writer=None`` (a v1 publisher) deletes only v1
    manifests and v1 data folders: older than the cutoff, or orphans. Never deleted: another
    writer's manifests and data, a manifest that does not parse or that holds another step
    than its name (unknown owner), and data of such a step. Orphans are data folders of steps
    at or before the writer's newest committed step that the manifest of that step does not
    reference (attempts killed before their manifest). ``known`` caches
    ``step -> (kind, data folders, writer)`` between calls. Returns the deleted paths.
    """
    objects = await store.list()
    manifests = {s: o.path for o in objects if (s := parse_manifest_path(o.path)) is not None}
    if not manifests:
        return []
    for step in manifests.keys() - known.keys():
        try:
            m = Manifest.from_json(await store.read(manifests[step]), source=manifests[step])
        except (FormatError, NotFoundError):
            continue  # unreadable (or gone): its owner is unknown, it is never deleted
        if m.step != step:
            continue  # a manifest of another step under this name: unknown owner, kept
        known[step] = (m.kind, frozenset(f.path.rsplit("/", 1)[0] for f in m.files), m.writer)

    def owner(step: int) -> str | None:
        return known[step][2]

    mine = [s for s in manifests if s in known and owner(s) == writer]
    if not mine:
        return []  # nothing of its own committed: no cutoff, no newest step for orphans
    anchors = sorted(s for s in mine if known[s][0] == "anchor")
    cutoff = anchors[-keep_anchors] if len(anchors) >= keep_anchors else -1
    newest = max(mine)
    # own steps, and v1 (anonymous, readable) steps, older than the cutoff (for writer None
    # both are the v1 steps)
    doomed_steps = {s for s in manifests if s < cutoff and s in known and owner(s) in (writer, None)}
    doomed_manifests = [manifests[s] for s in sorted(doomed_steps)]
    doomed_data = []
    for o in objects:
        parsed = parse_data_path(o.path)
        if parsed is None:
            continue
        step, token = parsed
        by = token_writer(token)
        if by is not None and by != writer:
            continue  # another writer's data: never
        if step in manifests and step not in known:
            continue  # its step's manifest is unreadable: it may reference this folder
        referenced = step in known and data_dir(step, token) in known[step][1]
        if referenced and step not in doomed_steps:
            continue  # data of a kept step (whoever's manifest references it)
        if by is None and writer is not None:  # v1 data, seen by a v2/v3 writer: old only
            if step < cutoff:
                doomed_data.append(o.path)
            continue
        orphan = step <= newest and not referenced
        if step < cutoff or orphan:
            doomed_data.append(o.path)
    await store.delete(doomed_manifests)  # manifests first: no reader sees a step losing data
    await store.delete(doomed_data)
    for step in [s for s in known if s in doomed_steps]:
        del known[step]
    return doomed_manifests + doomed_data


__all__ = ["retain"]

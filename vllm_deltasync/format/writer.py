"""Writing one step into a bucket (data files, then the manifest) and retention.

Used by the publisher's upload thread. ``write_step`` encodes each tensor's payload in
chunks, packs chunks into safetensors files of about ``max_file_bytes``, writes the files
(a few at a time) and finally the manifest, whose existence commits the step.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import MutableMapping
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from safetensors.torch import save as save_safetensors

from vllm_deltasync._loop import BackgroundLoop
from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.codec import Codec
from vllm_deltasync.format.codecs import get_codec
from vllm_deltasync.format.layout import (
    data_dir,
    data_path,
    manifest_path,
    parse_data_path,
    parse_manifest_path,
)
from vllm_deltasync.format.manifest import (
    FORMAT_NAME,
    Chunk,
    FileEntry,
    Kind,
    Manifest,
    TensorEntry,
    Totals,
)
from vllm_deltasync.stores import Store

MAX_WRITES_IN_FLIGHT = 4


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


class _Files:
    """Packs chunk tensors into safetensors files and writes them as they fill up."""

    def __init__(self, store: Store, loop: BackgroundLoop, step: int, kind: Kind,
                 max_file_bytes: int, timeout_s: float) -> None:
        self.store, self.loop, self.step, self.kind = store, loop, step, kind
        self.max_file_bytes, self.timeout_s = max_file_bytes, timeout_s
        self.token = secrets.token_hex(8)
        self.entries: list[FileEntry] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.owners: set[str] = set()
        self.size = 0
        self.pending: list[Future[None]] = []

    def add(self, owner: str, tensors: dict[str, torch.Tensor]) -> int:
        """Put one chunk's tensors (key -> tensor) in the current file; returns its index."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.tensors and self.size + nbytes > self.max_file_bytes:
            self.flush()
        if owner in self.owners:  # two chunks of one tensor: must not share storage in a file
            tensors = {k: t.clone() for k, t in tensors.items()}
        for key, tensor in tensors.items():
            if key in self.tensors:
                raise FormatError(f"step {self.step}: safetensors key {key!r} is used twice")
            self.tensors[key] = tensor
        self.owners.add(owner)
        self.size += nbytes
        return len(self.entries)

    def flush(self) -> None:
        if not self.tensors:
            return
        meta = {"format": FORMAT_NAME, "schema_version": "1",
                "step": str(self.step), "kind": self.kind}
        data = save_safetensors(self.tensors, metadata=meta)
        path = data_path(self.step, self.token, len(self.entries))
        self.entries.append(FileEntry(path, len(data), hashlib.sha256(data).hexdigest()))
        self.tensors, self.owners, self.size = {}, set(), 0
        self.pending.append(self.loop.submit(self.store.write(path, data)))
        if len(self.pending) >= MAX_WRITES_IN_FLIGHT:
            self.pending.pop(0).result(self.timeout_s)

    def finish(self) -> tuple[FileEntry, ...]:
        """Write the last file and wait for every write; the first error is raised."""
        try:
            self.flush()
        finally:
            errors = []
            for future in self.pending:
                try:
                    future.result(self.timeout_s)
                except BaseException as exc:
                    errors.append(exc)
            self.pending = []
        if errors:
            raise errors[0]
        return tuple(self.entries)


def _encode_item(item: StepItem, codec: Codec, files: _Files) -> TensorEntry:
    count = item.new_values.numel()
    per_chunk = max(1, files.max_file_bytes // codec.max_bytes_per_element)
    chunks: list[Chunk] = []
    for start in range(0, count, per_chunk):
        stop = min(count, start + per_chunk)
        indices = None if item.indices is None else item.indices[start:stop]
        old = None if item.old_values is None else item.old_values[start:stop]
        roles, meta = codec.encode(indices, item.new_values[start:stop], old)
        keys = {role: codec.key(item.name, role, start) for role in roles}
        index = files.add(item.name, {keys[r]: t.reshape(-1).contiguous() for r, t in roles.items()})
        chunks.append(Chunk(index, keys, start, stop, dict(meta)))
    return TensorEntry(item.name, item.shape, "bfloat16", codec.name, item.changed, tuple(chunks))


def write_step(store: Store, loop: BackgroundLoop, step: int, kind: Kind, base_step: int | None,
               anchor_step: int, fp: str, totals: tuple[int, int], items: list[StepItem], *,
               codec: str, max_file_bytes: int, timeout_s: float) -> Manifest:
    """Write the data files of one step, then its manifest. Returns the committed manifest."""
    files = _Files(store, loop, step, kind, max_file_bytes, timeout_s)
    dense, sparse = get_codec("dense"), get_codec(codec)
    entries = []
    try:
        for item in items:
            entries.append(_encode_item(item, dense if item.indices is None else sparse, files))
    finally:
        file_entries = files.finish()
    manifest = Manifest(
        step=step, kind=kind, base_step=base_step, anchor_step=anchor_step,
        created_at=time.time(), fingerprint=fp, files=file_entries, tensors=tuple(entries),
        totals=Totals(totals[0], totals[1], sum(e.changed for e in entries),
                      sum(f.size for f in file_entries)),
        schema_version=1,
    )
    loop.run(store.write(manifest_path(step), manifest.to_json()), timeout_s)
    return manifest


async def retain(store: Store, keep_anchors: int,
                 known: MutableMapping[int, tuple[str, frozenset[str]]]) -> list[str]:
    """Delete steps older than the ``keep_anchors``-th newest anchor and orphaned data.

    Orphans are data folders of steps at or before the newest committed step that its
    manifest does not reference (attempts killed before their manifest). ``known`` caches
    ``step -> (kind, data folders)`` between calls. Returns the deleted paths.
    """
    objects = await store.list()
    manifests = {s: o.path for o in objects if (s := parse_manifest_path(o.path)) is not None}
    if not manifests:
        return []
    for step in manifests.keys() - known.keys():
        try:
            m = Manifest.from_json(await store.read(manifests[step]), source=manifests[step])
        except FormatError:
            continue  # unreadable: never an anchor, and its data is kept unless too old
        known[step] = (m.kind, frozenset(f.path.rsplit("/", 1)[0] for f in m.files))
    anchors = sorted(s for s in manifests if s in known and known[s][0] == "anchor")
    cutoff = anchors[-keep_anchors] if len(anchors) >= keep_anchors else -1
    newest = max(manifests)
    doomed_manifests = [p for s, p in manifests.items() if s < cutoff]
    doomed_data = []
    for o in objects:
        parsed = parse_data_path(o.path)
        if parsed is None:
            continue
        step, token = parsed
        orphan = step <= newest and (
            step not in manifests or (step in known and data_dir(step, token) not in known[step][1])
        )
        if step < cutoff or orphan:
            doomed_data.append(o.path)
    await store.delete(doomed_manifests)  # manifests first: no reader sees a step losing data
    await store.delete(doomed_data)
    for step in [s for s in known if s < cutoff]:
        del known[step]
    return doomed_manifests + doomed_data

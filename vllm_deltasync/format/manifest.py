"""The manifest: one JSON document per committed step, and the names of everything in a bucket.

Layout under a bucket prefix (docs/format.md is the full specification)::

    manifests/000000000042.json                    commit point of step 42 (written last)
    data/000000000042-<token>/00000.safetensors    data files of step 42, one token per attempt

A manifest lists every data file with its size and sha256 and, per tensor, where its chunks
live. ``Manifest.from_json`` validates the whole document and raises :class:`FormatError`
naming the source when anything is off, so code past it can trust the fields.

This module is ``Manifest``, ``fingerprint`` and ``manifest_identity``, and the public path of
the rest: the records (``FileEntry``, ``TensorEntry``, ``Chunk``, ``Region``, ...) live in
``_manifest_entries.py``, the JSON document in ``_manifest_json.py``, its validation in
``_manifest_schema.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_deltasync.format._manifest_entries import (
    FORMAT_NAME,
    MAX_REGION_ROWS,
    MIN_READER,
    READS,
    ROLE_DTYPES,
    SCHEMA_VERSION,
    Chunk,
    FileEntry,
    Kind,
    Region,
    RoleRange,
    TensorEntry,
    Totals,
    merge_ranges,
)
from vllm_deltasync.format._manifest_json import (
    MAX_MANIFEST_BYTES,
    TABLE_KEY,
    dump_document,
    load_document,
    min_reader,
    to_document,
)
from vllm_deltasync.format._manifest_schema import MAX_INT, parse_manifest
from vllm_deltasync.format.adapter import AdapterInfo
from vllm_deltasync.format.layout import manifest_path
from vllm_deltasync.format.limits import MAX_NDIM, MAX_NUMEL


def manifest_identity(data: bytes | memoryview) -> str:
    """The identity of a committed step: ``"sha256:<hex>"`` of its manifest's bytes exactly as
    committed (docs/format.md §9). Two steps with one number but different content (a trainer
    restarted from a checkpoint, a second writer, a wiped bucket) have different identities."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def fingerprint(params: Iterable[tuple[str, Sequence[int], str]]) -> str:
    """``"sha256:<hex>"`` of the parameter set: sorted ``[name, shape, dtype]`` as compact JSON."""
    rows = sorted([name, [int(d) for d in shape], str(dtype)] for name, shape, dtype in params)
    text = json.dumps(rows, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """The commit record of one step."""

    step: int
    kind: Kind
    base_step: int | None
    """Delta: the step it applies on. Anchor: None."""
    anchor_step: int
    """The anchor the chain starts from (an anchor's own step)."""
    created_at: float
    """Unix time of the commit."""
    fingerprint: str
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    totals: Totals
    schema_version: int = SCHEMA_VERSION
    format: str = FORMAT_NAME
    run_id: str | None = None
    """v2: the training run (lowercase hex); a chain never crosses runs."""
    writer: str | None = None
    """v2: the writer token (lowercase hex): one publisher, or every rank of one sharded job."""
    requires: str | None = None
    """v2: the first reader release that reads this manifest, ``"vllm-deltasync>=X.Y.Z"``."""
    base_id: str | None = None
    """v2 delta (written since 0.5.0): the identity of the manifest it was computed from
    (:func:`manifest_identity`); a reader applies the delta only onto exactly that step."""
    resumed_from: int | None = None
    """v2 anchor, optional: the training step of the checkpoint a restarted trainer resumed
    from (informative; readers follow identities, not this number)."""
    adapter: AdapterInfo | None = None
    """v2, optional: the LoRA adapter an adapter bucket's tensors are (format/adapter.py), on
    every step of such a bucket; None for model weights."""
    identity: str | None = field(default=None, compare=False)
    """The identity of this manifest's committed bytes: set by :meth:`from_json` and by the
    writer once the bytes exist; never part of the document."""

    @property
    def path(self) -> str:
        return manifest_path(self.step)

    @property
    def sparsity(self) -> float:
        """Fraction of elements unchanged since the previous step."""
        if self.totals.elements == 0:
            return 1.0
        return 1.0 - self.totals.changed / self.totals.elements

    def tensor(self, name: str) -> TensorEntry | None:
        for entry in self.tensors:
            if entry.name == name:
                return entry
        return None

    def to_dict(self) -> dict[str, Any]:
        """The expanded JSON document (the tensor table as a list, at any version)."""
        return to_document(self)

    def to_json(self) -> bytes:
        """The manifest document. Version 3 stores the tensor table deflated (§4 of
        docs/format.md); :meth:`to_dict` is the same document with the table expanded."""
        return dump_document(self.to_dict())

    @classmethod
    def from_json(cls, data: bytes, *, source: str) -> Manifest:
        """Parse and validate; :class:`FormatError` naming ``source`` on any defect."""
        return cls(**parse_manifest(data, source), identity=manifest_identity(data))


__all__ = [
    "FORMAT_NAME",
    "MAX_INT",
    "MAX_MANIFEST_BYTES",
    "MAX_NDIM",
    "MAX_NUMEL",
    "MAX_REGION_ROWS",
    "MIN_READER",
    "READS",
    "ROLE_DTYPES",
    "SCHEMA_VERSION",
    "TABLE_KEY",
    "Chunk",
    "Region",
    "RoleRange",
    "dump_document",
    "load_document",
    "merge_ranges",
    "min_reader",
    "FileEntry",
    "Kind",
    "Manifest",
    "TensorEntry",
    "Totals",
    "fingerprint",
    "manifest_identity",
]

"""The manifest: one JSON document per committed step, and the names of everything in a bucket.

Layout under a bucket prefix (docs/format.md is the full specification)::

    manifests/000000000042.json                    commit point of step 42 (written last)
    data/000000000042-<token>/00000.safetensors    data files of step 42, one token per attempt

A manifest lists every data file with its size and sha256 and, per tensor, where its chunks
live. ``Manifest.from_json`` validates the whole document and raises :class:`FormatError`
naming the source when anything is off, so code past it can trust the fields.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.layout import manifest_path

Kind = Literal["anchor", "delta"]

FORMAT_NAME = "vllm-deltasync"
SCHEMA_VERSION = 1

def fingerprint(params: Iterable[tuple[str, Sequence[int], str]]) -> str:
    """``"sha256:<hex>"`` of the parameter set: sorted ``[name, shape, dtype]`` as compact JSON."""
    rows = sorted([name, [int(d) for d in shape], str(dtype)] for name, shape, dtype in params)
    text = json.dumps(rows, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class FileEntry:
    """One data file of a step."""

    path: str
    """Path relative to the bucket prefix."""
    size: int
    """Size in bytes."""
    sha256: str
    """Lowercase hex sha256 of the whole file."""


@dataclass(frozen=True)
class Chunk:
    """One piece of one tensor inside one data file."""

    file: int
    """Index into ``Manifest.files``."""
    keys: dict[str, str]
    """Role -> safetensors key, e.g. ``{"indices": "w.indices", "values": "w.values"}``."""
    start: int
    """Dense: first flat element. Sparse: first position in the tensor's changed-element list."""
    stop: int
    """End (exclusive) of the same range."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Codec parameters for this chunk (JSON values); empty for dense and sparse-v1."""

    @property
    def count(self) -> int:
        """Elements this chunk carries."""
        return self.stop - self.start


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a step."""

    name: str
    """Checkpoint (Hugging Face) name."""
    shape: tuple[int, ...]
    """Full checkpoint shape."""
    dtype: str
    """Element type of the reconstructed tensor: ``"bfloat16"``."""
    encoding: str
    """Codec name: ``"dense"``, ``"sparse-v1"`` or a registered codec."""
    changed: int
    """Elements that differ from the previous published step (anchors: informative)."""
    chunks: tuple[Chunk, ...]
    """Where the payload lives, in range order."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Totals:
    """Sums over a step."""

    tensors: int
    """Parameters in the parameter set (not only those listed)."""
    elements: int
    """Elements in the parameter set."""
    changed: int
    """Changed elements (sum of ``TensorEntry.changed``)."""
    bytes: int
    """Bytes of all data files."""


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
        return {
            "format": self.format,
            "schema_version": self.schema_version,
            "step": self.step,
            "kind": self.kind,
            "base_step": self.base_step,
            "anchor_step": self.anchor_step,
            "created_at": self.created_at,
            "fingerprint": self.fingerprint,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
            "tensors": [_tensor_to_dict(t) for t in self.tensors],
            "totals": {
                "tensors": self.totals.tensors,
                "elements": self.totals.elements,
                "changed": self.totals.changed,
                "bytes": self.totals.bytes,
            },
        }

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, source: str) -> Manifest:
        """Parse and validate; :class:`FormatError` naming ``source`` on any defect."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"{source}: not valid JSON ({exc})") from exc
        try:
            return _from_dict(doc)
        except FormatError as exc:
            raise FormatError(f"{source}: {exc}") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{source}: malformed manifest ({type(exc).__name__}: {exc})") from exc


def _tensor_to_dict(t: TensorEntry) -> dict[str, Any]:
    return {
        "name": t.name,
        "shape": list(t.shape),
        "dtype": t.dtype,
        "encoding": t.encoding,
        "changed": t.changed,
        "chunks": [
            {"file": c.file, "keys": dict(c.keys), "start": c.start, "stop": c.stop, "meta": c.meta}
            for c in t.chunks
        ],
    }


def _int(doc: Mapping[str, Any], key: str, *, minimum: int = 0) -> int:
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise FormatError(f"field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _str(doc: Mapping[str, Any], key: str) -> str:
    value = doc[key]
    if not isinstance(value, str) or not value:
        raise FormatError(f"field {key!r} must be a non-empty string, got {value!r}")
    return value


def _from_dict(doc: Any) -> Manifest:
    if not isinstance(doc, dict):
        raise FormatError("the manifest is not a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise FormatError(f"format is {doc.get('format')!r}, expected {FORMAT_NAME!r}")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise FormatError(
            f"schema_version {doc.get('schema_version')!r} is not supported (this reader knows "
            f"{SCHEMA_VERSION}); upgrade vllm-deltasync"
        )
    step = _int(doc, "step")
    kind, base, anchor = _chain_fields(doc, step)
    files = tuple(_file_from_dict(f) for f in doc["files"])
    tensors = tuple(_tensor_from_dict(t, len(files)) for t in doc["tensors"])
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise FormatError("a tensor name is listed twice")
    totals_doc = doc["totals"]
    totals = Totals(*(_int(totals_doc, k) for k in ("tensors", "elements", "changed", "bytes")))
    if totals.bytes != sum(f.size for f in files):
        raise FormatError(f"totals.bytes {totals.bytes} is not the sum of the file sizes")
    created = doc["created_at"]
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise FormatError(f"field 'created_at' must be a number, got {created!r}")
    fp = _str(doc, "fingerprint")
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", fp):
        raise FormatError(f"fingerprint {fp!r} is not 'sha256:<64 hex>'")
    return Manifest(step, kind, base, anchor, float(created), fp, files, tensors, totals)


def _chain_fields(doc: Mapping[str, Any], step: int) -> tuple[Kind, int | None, int]:
    kind = doc["kind"]
    anchor = _int(doc, "anchor_step")
    if kind == "anchor":
        if doc["base_step"] is not None or anchor != step:
            raise FormatError("an anchor has base_step null and anchor_step equal to its step")
        return "anchor", None, anchor
    if kind != "delta":
        raise FormatError(f"kind {kind!r} is neither 'anchor' nor 'delta'")
    base = _int(doc, "base_step")
    if not anchor <= base < step:
        raise FormatError(f"a delta needs anchor_step <= base_step < step, got {anchor}, {base}, {step}")
    return "delta", base, anchor


def _file_from_dict(doc: Mapping[str, Any]) -> FileEntry:
    path = _str(doc, "path")
    if path.startswith("/") or ".." in path.split("/"):
        raise FormatError(f"file path {path!r} must be relative to the bucket prefix")
    sha = _str(doc, "sha256")
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise FormatError(f"sha256 of {path!r} is not 64 lowercase hex digits")
    return FileEntry(path, _int(doc, "size"), sha)


def _tensor_from_dict(doc: Mapping[str, Any], n_files: int) -> TensorEntry:
    name = _str(doc, "name")
    shape = tuple(int(d) for d in doc["shape"])
    if any(d < 0 for d in shape):
        raise FormatError(f"tensor {name!r}: negative dimension in {shape}")
    chunks = tuple(_chunk_from_dict(c, name, n_files) for c in doc["chunks"])
    entry = TensorEntry(
        name, shape, _str(doc, "dtype"), _str(doc, "encoding"), _int(doc, "changed"), chunks
    )
    if entry.dtype != "bfloat16":
        raise FormatError(f"tensor {name!r}: dtype {entry.dtype!r} is not 'bfloat16'")
    if entry.changed > entry.numel:
        raise FormatError(f"tensor {name!r}: changed {entry.changed} > {entry.numel} elements")
    return entry


def _chunk_from_dict(doc: Mapping[str, Any], name: str, n_files: int) -> Chunk:
    file = _int(doc, "file")
    if file >= n_files:
        raise FormatError(f"tensor {name!r}: chunk names file {file}, the step has {n_files}")
    keys = doc["keys"]
    if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
        raise FormatError(f"tensor {name!r}: chunk keys must map roles to strings")
    meta = doc.get("meta", {})
    if not isinstance(meta, dict):
        raise FormatError(f"tensor {name!r}: chunk meta must be an object")
    start, stop = _int(doc, "start"), _int(doc, "stop")
    if stop < start:
        raise FormatError(f"tensor {name!r}: chunk range [{start}, {stop}) is reversed")
    return Chunk(file, dict(keys), start, stop, dict(meta))


__all__ = [
    "FORMAT_NAME",
    "SCHEMA_VERSION",
    "Chunk",
    "FileEntry",
    "Kind",
    "Manifest",
    "TensorEntry",
    "Totals",
    "fingerprint",
]

"""The manifest: one JSON document per committed step, and the names of everything in a bucket.

Layout under a bucket prefix (docs/format.md is the full specification)::

    manifests/000000000042.json                    commit point of step 42 (written last)
    data/000000000042-<token>/00000.safetensors    data files of step 42, one token per attempt

A manifest lists every data file with its size and sha256 and, per tensor, where its chunks
live. ``Manifest.from_json`` validates the whole document and raises :class:`FormatError`
naming the source when anything is off, so code past it can trust the fields.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeGuard

from vllm_deltasync.errors import FormatError, UnsupportedFormatError
from vllm_deltasync.format.layout import manifest_path

Kind = Literal["anchor", "delta"]

FORMAT_NAME = "vllm-deltasync"
SCHEMA_VERSION = 3
"""The newest format version: what the publisher writes and the highest one this reader reads."""
READS = (1, 2, 3)
"""Format versions this reader reads (version 1 is read indefinitely)."""
MIN_READER = {1: "0.1.0", 2: "0.2.0", 3: "0.4.0"}
"""Format version -> the first vllm-deltasync release that reads it (written as ``requires``)."""
ROLE_DTYPES = ("BF16", "I16", "I32", "I64", "U8")
"""Safetensors dtypes a v2 chunk role may have."""
_HEX_ID = re.compile(r"[0-9a-f]{8,64}")
MAX_NDIM = 8
"""Most dimensions a tensor may have."""
MAX_NUMEL = 1 << 40
"""Most elements one tensor may claim (2 TiB of bf16): a larger claim is refused by the parser
before anything is sized by it."""
MAX_INT = (1 << 53) - 1
"""Largest integer any manifest field may hold (sizes, offsets, counts; exact in JSON doubles)."""
MAX_REGION_ROWS = 1 << 23
"""Most region rows the chunks of one tensor may list together (the coverage check's memory)."""
MAX_MANIFEST_BYTES = 64 << 20
"""Largest manifest document a reader parses."""
_BAD_PATH_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")
_IDENTITY = re.compile(r"sha256:[0-9a-f]{64}")


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
class FileEntry:
    """One data file of a step."""

    path: str
    """Path relative to the bucket prefix."""
    size: int
    """Size in bytes."""
    sha256: str
    """Lowercase hex sha256 of the whole file."""
    index: Mapping[str, tuple[tuple[int, int], ...]] | None = None
    """v2: tensor name -> its byte ranges ``(offset, length)`` in this file, ascending, merged."""


@dataclass(frozen=True)
class RoleRange:
    """v2: where one role of one chunk lies in its data file."""

    key: str
    """Safetensors key (for readers of whole files)."""
    dtype: str
    """Safetensors dtype: BF16, I16, I32, I64 or U8."""
    offset: int
    """First byte, counted from the start of the file."""
    length: int
    """Bytes."""


@dataclass(frozen=True)
class Region:
    """v2: the flat elements a chunk may touch, and how its local indices map to them.

    Local index ``j`` in ``[0, rows * row_len)`` is flat element
    ``offset + (j // row_len) * row_stride + j % row_len`` (rows of a column shard). A
    contiguous region has ``rows == 1``.
    """

    offset: int
    rows: int
    row_len: int
    row_stride: int

    @property
    def size(self) -> int:
        return self.rows * self.row_len

    def to_json(self) -> list[int]:
        if self.rows == 1:
            return [self.offset, self.row_len]
        return [self.offset, self.rows, self.row_len, self.row_stride]

    def intervals(self) -> list[tuple[int, int]]:
        """Flat ``[start, stop)`` runs covered, ascending."""
        return [(self.offset + r * self.row_stride, self.offset + r * self.row_stride + self.row_len)
                for r in range(self.rows)] if self.row_len else []


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
    region: Region | None = None
    """v2: the elements this chunk may touch (v1: None; ``start``/``stop`` place it)."""
    roles: Mapping[str, RoleRange] | None = None
    """v2: role -> byte range in the file."""
    sha256: str | None = None
    """v2: sha256 of the chunk's role bytes, roles in sorted name order, concatenated."""

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
    """Where the payload lives (v1: in range order; v2: any order)."""
    codec_version: int = 1
    """Version of ``encoding`` (every codec of this release is at version 1)."""

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
        if self.schema_version >= 2:
            return _to_dict_v2(self)
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
        """The manifest document. Version 3 stores the tensor table deflated (§4 of
        docs/format.md); :meth:`to_dict` is the same document with the table expanded."""
        return dump_document(self.to_dict())

    @classmethod
    def from_json(cls, data: bytes, *, source: str) -> Manifest:
        """Parse and validate; :class:`FormatError` naming ``source`` on any defect."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise FormatError(f"{source}: {len(data)} bytes, more than a manifest may have "
                              f"({MAX_MANIFEST_BYTES})")
        try:
            text = bytes(data).decode("utf-8")  # strict: json.loads would also take UTF-16/32
            doc = json.loads(text, parse_constant=_no_constant)
        except UnicodeDecodeError as exc:
            raise FormatError(f"{source}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise FormatError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        except RecursionError:
            raise FormatError(f"{source}: JSON nested too deeply") from None
        except ValueError as exc:  # NaN / Infinity
            raise FormatError(f"{source}: {exc}") from None
        try:
            if isinstance(doc, dict) and doc.get("schema_version") == 3 and doc.get("format") == FORMAT_NAME:
                doc = _expand(doc)
            return replace(_from_dict(doc), identity=manifest_identity(data))
        except FormatError as exc:
            raise type(exc)(f"{source}: {exc}") from exc  # the class says what is wrong
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise FormatError(f"{source}: malformed manifest ({type(exc).__name__}: "
                              f"{str(exc)[:200]})") from None


def load_document(data: bytes) -> Any:
    """The JSON document of manifest bytes, a version 3 tensor table expanded to the version 2
    shape (for tools that read or edit manifests; :meth:`Manifest.from_json` validates)."""
    doc = json.loads(bytes(data).decode("utf-8"), parse_constant=_no_constant)
    if isinstance(doc, dict) and doc.get("schema_version") == 3 and TABLE_KEY in doc:
        doc = _expand(doc)
    return doc


def dump_document(doc: Mapping[str, Any]) -> bytes:
    """Manifest bytes of an expanded document (:func:`load_document`'s inverse): a version 3
    document is written with its tensor table deflated."""
    if doc.get("schema_version") == 3 and "tensors" in doc:
        doc = _compact(dict(doc))
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (NaN and Infinity are refused)")


def min_reader(m: Manifest) -> str:
    """The first release that reads ``m``: its format version's, or a newer one its codecs need."""
    from vllm_deltasync.format.codecs import CODECS  # the table imports this module

    versions = [MIN_READER[m.schema_version]]
    for t in m.tensors:
        codec = CODECS.get(t.encoding)
        if codec is not None and codec.min_reader:
            versions.append(codec.min_reader)
    return max(versions, key=lambda v: tuple(int(x) for x in v.split(".")))


def _to_dict_v2(m: Manifest) -> dict[str, Any]:
    return {
        "format": m.format,
        "schema_version": m.schema_version,
        "requires": m.requires or f"vllm-deltasync>={min_reader(m)}",
        "run_id": m.run_id,
        "writer": m.writer,
        **({"base_id": m.base_id} if m.base_id is not None else {}),
        **({"resumed_from": m.resumed_from} if m.resumed_from is not None else {}),
        "step": m.step,
        "kind": m.kind,
        "base_step": m.base_step,
        "anchor_step": m.anchor_step,
        "created_at": m.created_at,
        "fingerprint": m.fingerprint,
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256,
                   "index": {n: [list(r) for r in rs] for n, rs in (f.index or {}).items()}}
                  for f in m.files],
        "tensors": [{
            "name": t.name, "shape": list(t.shape), "dtype": t.dtype, "encoding": t.encoding,
            "codec_version": t.codec_version, "changed": t.changed,
            "chunks": [{
                "file": c.file, "count": c.count,
                "region": c.region.to_json() if c.region else None,
                "roles": {r: {"key": v.key, "dtype": v.dtype, "offset": v.offset, "length": v.length}
                          for r, v in (c.roles or {}).items()},
                "sha256": c.sha256, "meta": c.meta,
            } for c in t.chunks],
        } for t in m.tensors],
        "totals": {"tensors": m.totals.tensors, "elements": m.totals.elements,
                   "changed": m.totals.changed, "bytes": m.totals.bytes},
    }


TABLE_KEY = "tensors_deflate"
"""Version 3: the field holding the tensor table, base64 of zlib-deflated compact JSON."""


def _compact(doc: dict[str, Any]) -> dict[str, Any]:
    """Version 3 document from the expanded one: the tensor table deflated, each file's index
    left out (it is exactly the merged byte ranges of its chunks: the reader rebuilds it)."""
    out = {k: v for k, v in doc.items() if k != "tensors"}
    out["files"] = [{k: v for k, v in f.items() if k != "index"} for f in doc["files"]]
    table = json.dumps(doc["tensors"], separators=(",", ":")).encode("utf-8")
    out[TABLE_KEY] = base64.b64encode(zlib.compress(table, 9)).decode("ascii")
    return out


def _expand(doc: dict[str, Any]) -> dict[str, Any]:
    """The expanded version 3 document (tensor table inflated, file indexes rebuilt); the
    inflated size is bounded by :data:`MAX_MANIFEST_BYTES` before anything is allocated by it."""
    raw = doc.get(TABLE_KEY)
    if not isinstance(raw, str):
        raise FormatError(f"field {TABLE_KEY!r} must be a base64 string")
    try:
        deflated = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise FormatError(f"field {TABLE_KEY!r} is not valid base64") from None
    inflater = zlib.decompressobj()
    try:
        table = inflater.decompress(deflated, MAX_MANIFEST_BYTES)
    except zlib.error as exc:
        raise FormatError(f"field {TABLE_KEY!r} is not a zlib stream ({exc})") from None
    if inflater.unconsumed_tail:
        raise FormatError(f"field {TABLE_KEY!r} inflates to more than {MAX_MANIFEST_BYTES} bytes")
    if not inflater.eof or inflater.unused_data:
        raise FormatError(f"field {TABLE_KEY!r}: the zlib stream is truncated or followed by junk")
    try:
        tensors = json.loads(table.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise FormatError(f"field {TABLE_KEY!r}: the table is not UTF-8 ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise FormatError(f"field {TABLE_KEY!r}: the table is not valid JSON ({exc.msg})") from None
    if not isinstance(tensors, list) or not all(isinstance(t, dict) for t in tensors):
        raise FormatError(f"field {TABLE_KEY!r}: the table is not a list of tensor objects")
    files = doc["files"]
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise FormatError("field 'files' must be a list of objects")
    if any("index" in f for f in files):
        raise FormatError("a version 3 manifest lists no file index (the reader rebuilds it)")

    def role_ranges() -> Iterator[tuple[int, str, int, int]]:
        for t in tensors:  # malformed entries are skipped here; the v2 parser names them
            for c in t.get("chunks") or ():
                file, roles = (c.get("file"), c.get("roles")) if isinstance(c, dict) else (None, None)
                if not _is_int(file) or not 0 <= file < len(files) or not isinstance(roles, dict):
                    continue
                for r in roles.values():
                    if isinstance(r, dict) and _is_int(r.get("offset")) and _is_int(r.get("length")):
                        yield file, str(t.get("name")), r["offset"], r["length"]

    out = {k: v for k, v in doc.items() if k != TABLE_KEY}
    out["files"] = [{**f, "index": {n: [list(r) for r in rs] for n, rs in index.items()}}
                    for f, index in zip(files, _file_indexes(len(files), role_ranges()), strict=True)]
    out["tensors"] = tensors
    return out


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


def _int(doc: Mapping[str, Any], key: str, *, minimum: int = 0, maximum: int = MAX_INT) -> int:
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise FormatError(f"field {key!r} must be an integer in [{minimum}, {maximum}], "
                          f"got {str(value)[:40]}")
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
    version = doc.get("schema_version")
    if version not in READS:
        raise UnsupportedFormatError(_too_new(version, doc.get("requires")))
    step = _int(doc, "step")
    kind, base, anchor = _chain_fields(doc, step)
    files = tuple(_file_from_dict(f, version) for f in doc["files"])
    sizes = [f.size for f in files]
    tensors = tuple(_tensor_from_dict(t, sizes, version, doc.get("requires")) for t in doc["tensors"])
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise FormatError("a tensor name is listed twice")
    totals_doc = doc["totals"]
    totals = Totals(*(_int(totals_doc, k) for k in ("tensors", "elements", "changed", "bytes")))
    if totals.bytes != sum(f.size for f in files):
        raise FormatError(f"totals.bytes {totals.bytes} is not the sum of the file sizes")
    created = doc["created_at"]
    if (isinstance(created, bool) or not isinstance(created, (int, float))
            or not math.isfinite(created) or not 0 <= created < 1e11):
        raise FormatError(f"field 'created_at' must be a finite number of seconds since the "
                          f"epoch, got {str(created)[:40]}")
    fp = _str(doc, "fingerprint")
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", fp):
        raise FormatError(f"fingerprint {fp!r} is not 'sha256:<64 hex>'")
    if version == 1:
        return Manifest(step, kind, base, anchor, float(created), fp, files, tensors, totals,
                        schema_version=1)
    run_id, writer, requires = _hex_id(doc, "run_id"), _hex_id(doc, "writer"), _str(doc, "requires")
    _check_file_index(files, tensors)
    base_id = doc.get("base_id")
    if base_id is not None and (kind != "delta" or not isinstance(base_id, str)
                                or not _IDENTITY.fullmatch(base_id)):
        raise FormatError(f"field 'base_id' must be 'sha256:<64 hex>' on a delta, got "
                          f"{str(base_id)[:80]!r} on a{'n' if kind == 'anchor' else ''} {kind}")
    resumed = doc.get("resumed_from")
    if resumed is not None:
        resumed = _int(doc, "resumed_from")
    return Manifest(step, kind, base, anchor, float(created), fp, files, tensors, totals,
                    schema_version=version, run_id=run_id, writer=writer, requires=requires,
                    base_id=base_id, resumed_from=resumed)


def _too_new(version: Any, requires: Any) -> str:
    """The one-line refusal of a manifest this reader cannot read."""
    reads = ", ".join(str(v) for v in READS)
    hint = (f"it needs {requires}" if isinstance(requires, str) and requires
            else "upgrade vllm-deltasync")
    return (f"schema_version {version!r} (the format version) is not supported: this reader "
            f"reads format versions {reads}; {hint}")


def _hex_id(doc: Mapping[str, Any], key: str) -> str:
    value = _str(doc, key)
    if not _HEX_ID.fullmatch(value):
        raise FormatError(f"field {key!r} must be 8-64 lowercase hex digits, got {value!r}")
    return value


def _file_indexes(n_files: int, role_ranges: Iterable[tuple[int, str, int, int]]
                  ) -> list[dict[str, tuple[tuple[int, int], ...]]]:
    """Each file's index (§4): tensor name -> the merged ``(offset, length)`` byte ranges of its
    chunks' roles in that file, from ``(file, tensor name, offset, length)`` of every role."""
    ranges: list[dict[str, list[tuple[int, int]]]] = [{} for _ in range(n_files)]
    for file, name, offset, length in role_ranges:
        ranges[file].setdefault(name, []).append((offset, length))
    return [{name: merge_ranges(rs) for name, rs in found.items()} for found in ranges]


def _check_file_index(files: Sequence[FileEntry], tensors: Sequence[TensorEntry]) -> None:
    """Each file's index must be exactly the merged byte ranges of the chunks it holds."""
    expected = _file_indexes(len(files), ((c.file, t.name, r.offset, r.length)
                                          for t in tensors for c in t.chunks
                                          for r in (c.roles or {}).values()))
    for f, index in zip(files, expected, strict=True):
        if dict(f.index or {}) != index:
            raise FormatError(f"the index of {f.path} does not match the byte ranges of its chunks")


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted ``(offset, length)`` ranges, adjacent or overlapping ones merged."""
    out: list[list[int]] = []
    for off, length in sorted(ranges):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + length - out[-1][0])
        else:
            out.append([off, length])
    return tuple((a, b) for a, b in out)


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


def _file_from_dict(doc: Mapping[str, Any], version: int) -> FileEntry:
    path = _str(doc, "path")
    if path.startswith("/") or ".." in path.split("/") or _BAD_PATH_CHARS.search(path) or len(path) > 1024:
        raise FormatError(f"file path {path[:200]!r} must be a relative path inside the bucket "
                          "prefix (no '..', no control or NUL characters, no backslash)")
    sha = _str(doc, "sha256")
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise FormatError(f"sha256 of {path!r} is not 64 lowercase hex digits")
    size = _int(doc, "size")
    if version == 1:
        return FileEntry(path, size, sha)
    raw = doc["index"]
    if not isinstance(raw, dict):
        raise FormatError(f"index of {path!r} must be an object")
    index = {}
    for name, ranges in raw.items():
        if not isinstance(ranges, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(_is_int(x) and 0 <= x <= MAX_INT for x in r) for r in ranges
        ):
            raise FormatError(f"index of {path!r}: {name!r} must list [offset, length] pairs")
        index[name] = tuple((int(a), int(b)) for a, b in ranges)
    return FileEntry(path, size, sha, index)


def _is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _tensor_from_dict(doc: Mapping[str, Any], sizes: Sequence[int], version: int,
                      requires: Any) -> TensorEntry:
    name = _str(doc, "name")
    if len(name) > 1024 or "\x00" in name:
        raise FormatError(f"tensor name {name[:80]!r}...: longer than 1024 characters or holds NUL")
    raw_shape = doc["shape"]
    if not isinstance(raw_shape, list) or len(raw_shape) > MAX_NDIM or not all(
            _is_int(d) and d >= 0 for d in raw_shape):
        raise FormatError(f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} integers "
                          f">= 0, got {str(raw_shape)[:80]}")
    shape = tuple(raw_shape)
    numel = 1
    for d in shape:
        numel *= d
    if numel > MAX_NUMEL:
        raise FormatError(f"tensor {name!r}: shape {list(shape)} claims {numel} elements, more "
                          f"than a tensor may have ({MAX_NUMEL})")
    if version == 1:
        chunks = tuple(_chunk_from_dict(c, name, len(sizes)) for c in doc["chunks"])
        codec_version = 1
    else:
        chunks = tuple(_chunk_v2(c, name, sizes, numel) for c in doc["chunks"])
        codec_version = _int(doc, "codec_version", minimum=1)
    entry = TensorEntry(
        name, shape, _str(doc, "dtype"), _str(doc, "encoding"), _int(doc, "changed"), chunks,
        codec_version,
    )
    _check_codec(entry, requires)
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


def _check_codec(entry: TensorEntry, requires: Any) -> None:
    from vllm_deltasync.format.codecs import CODECS  # the table imports this module

    codec = CODECS.get(entry.encoding)
    if codec is None or entry.codec_version > codec.version:
        have = ", ".join(f"{n} v{c.version}" for n, c in sorted(CODECS.items()))
        hint = (f"the manifest says it needs {requires}" if isinstance(requires, str) and requires
                else "upgrade vllm-deltasync")
        raise UnsupportedFormatError(f"tensor {entry.name!r}: encoding {entry.encoding!r} version "
                          f"{entry.codec_version} is unknown to this reader (it reads {have}); {hint}")


def _chunk_v2(doc: Mapping[str, Any], name: str, sizes: Sequence[int], numel: int) -> Chunk:
    file = _int(doc, "file")
    if file >= len(sizes):
        raise FormatError(f"tensor {name!r}: chunk names file {file}, the step has {len(sizes)}")
    count = _int(doc, "count")
    region = _region(doc["region"], name, numel)
    if count > region.size:
        raise FormatError(f"tensor {name!r}: a chunk of {count} elements in a region of {region.size}")
    meta = doc["meta"]
    if not isinstance(meta, dict):
        raise FormatError(f"tensor {name!r}: chunk meta must be an object")
    raw_roles = doc["roles"]
    if not isinstance(raw_roles, dict) or not raw_roles:
        raise FormatError(f"tensor {name!r}: chunk roles must be a non-empty object")
    roles = {}
    for role, r in raw_roles.items():
        rr = RoleRange(_str(r, "key"), _str(r, "dtype"), _int(r, "offset"), _int(r, "length"))
        if rr.dtype not in ROLE_DTYPES:
            raise FormatError(f"tensor {name!r}: role {role!r} has dtype {rr.dtype!r}")
        if rr.offset + rr.length > sizes[file]:
            raise FormatError(f"tensor {name!r}: role {role!r} bytes [{rr.offset}, "
                              f"{rr.offset + rr.length}) lie outside its {sizes[file]}-byte file")
        roles[role] = rr
    sha = _str(doc, "sha256")
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise FormatError(f"tensor {name!r}: chunk sha256 is not 64 lowercase hex digits")
    return Chunk(file, {k: v.key for k, v in roles.items()}, 0, count, dict(meta), region, roles, sha)


def _region(raw: Any, name: str, numel: int) -> Region:
    if not isinstance(raw, list) or len(raw) not in (2, 4) or not all(_is_int(x) and 0 <= x <= MAX_INT for x in raw):
        raise FormatError(f"tensor {name!r}: chunk region must be [offset, length] or "
                          f"[offset, rows, row_len, row_stride] of integers >= 0, got {raw!r}")
    if len(raw) == 2:
        region = Region(raw[0], 1, raw[1], raw[1])
    else:
        region = Region(*raw)
        if region.rows < 1 or region.row_len > region.row_stride or (region.rows > 1 and region.row_len < 1):
            raise FormatError(f"tensor {name!r}: region {raw} needs rows >= 1, row_len <= row_stride "
                              "and rows of at least one element")
    end = region.offset + (region.rows - 1) * region.row_stride + region.row_len
    if end > numel:
        raise FormatError(f"tensor {name!r}: region {raw} ends at {end}, past its {numel} elements")
    return region


__all__ = [
    "FORMAT_NAME",
    "MAX_NUMEL",
    "MIN_READER",
    "READS",
    "SCHEMA_VERSION",
    "TABLE_KEY",
    "Chunk",
    "Region",
    "RoleRange",
    "dump_document",
    "load_document",
    "merge_ranges",
    "FileEntry",
    "Kind",
    "Manifest",
    "TensorEntry",
    "Totals",
    "fingerprint",
    "manifest_identity",
]

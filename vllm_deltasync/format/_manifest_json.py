"""The manifest's JSON document: bytes <-> the expanded document (version 3's tensor table
deflated on the way out, inflated and its file indexes rebuilt on the way in).

Validation of every field is :mod:`vllm_deltasync.format._manifest_schema`.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

from vllm_deltasync.errors import FormatError
from vllm_deltasync.format._manifest_entries import MIN_READER, TensorEntry, merge_ranges

if TYPE_CHECKING:
    from vllm_deltasync.format.manifest import Manifest

MAX_MANIFEST_BYTES = 64 << 20
"""Largest manifest document a reader parses."""


def read_document(data: bytes, source: str) -> Any:
    """The JSON value of manifest bytes (strict UTF-8, no NaN or Infinity, at most
    :data:`MAX_MANIFEST_BYTES`); :class:`FormatError` naming ``source`` otherwise."""
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
    return doc


def to_document(m: Manifest) -> dict[str, Any]:
    """The expanded JSON document of ``m`` (its tensor table as a list, at any version)."""
    if m.schema_version >= 2:
        return _to_dict_v2(m)
    return {
        "format": m.format,
        "schema_version": m.schema_version,
        "step": m.step,
        "kind": m.kind,
        "base_step": m.base_step,
        "anchor_step": m.anchor_step,
        "created_at": m.created_at,
        "fingerprint": m.fingerprint,
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in m.files],
        "tensors": [_tensor_to_dict(t) for t in m.tensors],
        "totals": {
            "tensors": m.totals.tensors,
            "elements": m.totals.elements,
            "changed": m.totals.changed,
            "bytes": m.totals.bytes,
        },
    }


def load_document(data: bytes) -> Any:
    """The JSON document of manifest bytes, a version 3 tensor table expanded to the version 2
    shape (for tools that read or edit manifests; :meth:`Manifest.from_json` validates)."""
    doc = json.loads(bytes(data).decode("utf-8"), parse_constant=_no_constant)
    if isinstance(doc, dict) and doc.get("schema_version") == 3 and TABLE_KEY in doc:
        doc = expand(doc)
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
        **({"adapter": m.adapter.to_dict()} if m.adapter is not None else {}),
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


def expand(doc: dict[str, Any]) -> dict[str, Any]:
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
                if not is_int(file) or not 0 <= file < len(files) or not isinstance(roles, dict):
                    continue
                for r in roles.values():
                    if isinstance(r, dict) and is_int(r.get("offset")) and is_int(r.get("length")):
                        yield file, str(t.get("name")), r["offset"], r["length"]

    out = {k: v for k, v in doc.items() if k != TABLE_KEY}
    out["files"] = [{**f, "index": {n: [list(r) for r in rs] for n, rs in index.items()}}
                    for f, index in zip(files, file_indexes(len(files), role_ranges()), strict=True)]
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


def file_indexes(n_files: int, role_ranges: Iterable[tuple[int, str, int, int]]
                  ) -> list[dict[str, tuple[tuple[int, int], ...]]]:
    """Each file's index (§4): tensor name -> the merged ``(offset, length)`` byte ranges of its
    chunks' roles in that file, from ``(file, tensor name, offset, length)`` of every role."""
    ranges: list[dict[str, list[tuple[int, int]]]] = [{} for _ in range(n_files)]
    for file, name, offset, length in role_ranges:
        ranges[file].setdefault(name, []).append((offset, length))
    return [{name: merge_ranges(rs) for name, rs in found.items()} for found in ranges]


def is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


__all__ = ["MAX_MANIFEST_BYTES", "TABLE_KEY", "dump_document", "expand", "file_indexes", "is_int",
           "load_document", "min_reader", "read_document", "to_document"]

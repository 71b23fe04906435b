"""The manifest's schema: every field of the expanded document checked, and the fields of
a ``Manifest`` built from it.

:func:`parse_manifest` raises :class:`FormatError` naming the source on any defect
(:class:`UnsupportedFormatError` for a newer format or an unknown codec), so code past it can
trust the fields.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_deltasync.errors import FormatError, UnsupportedFormatError
from vllm_deltasync.format._manifest_entries import (
    FORMAT_NAME,
    READS,
    ROLE_DTYPES,
    Chunk,
    FileEntry,
    Kind,
    Region,
    RoleRange,
    TensorEntry,
    Totals,
)
from vllm_deltasync.format._manifest_json import expand, file_indexes, is_int, read_document
from vllm_deltasync.format.adapter import AdapterInfo
from vllm_deltasync.format.limits import MAX_STEP, name_problem, shape_problem, shown, step_problem

_HEX_ID = re.compile(r"[0-9a-f]{8,64}")
MAX_INT = (1 << 53) - 1
"""Largest integer any manifest field may hold (sizes, offsets, counts; exact in JSON doubles)."""
_BAD_PATH_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")
_IDENTITY = re.compile(r"sha256:[0-9a-f]{64}")


def parse_manifest(data: bytes, source: str) -> dict[str, Any]:
    """The fields of the ``Manifest`` that ``data`` holds, validated; :class:`FormatError`
    naming ``source`` on any defect."""
    doc = read_document(data, source)
    try:
        if isinstance(doc, dict) and doc.get("schema_version") == 3 and doc.get("format") == FORMAT_NAME:
            doc = expand(doc)
        return _from_dict(doc)
    except FormatError as exc:
        raise type(exc)(f"{source}: {exc}") from exc  # the class says what is wrong
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise FormatError(f"{source}: malformed manifest ({type(exc).__name__}: "
                          f"{str(exc)[:200]})") from None


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


def _from_dict(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise FormatError("the manifest is not a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise FormatError(f"format is {doc.get('format')!r}, expected {FORMAT_NAME!r}")
    version = doc.get("schema_version")
    if version not in READS:
        raise UnsupportedFormatError(_too_new(version, doc.get("requires")))
    step = _int(doc, "step", maximum=MAX_STEP)
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
        return dict(step=step, kind=kind, base_step=base, anchor_step=anchor,
                    created_at=float(created), fingerprint=fp, files=files, tensors=tensors,
                    totals=totals, schema_version=1)
    run_id, writer, requires = _hex_id(doc, "run_id"), _hex_id(doc, "writer"), _str(doc, "requires")
    _check_file_index(files, tensors)
    base_id = doc.get("base_id")
    if base_id is not None and (kind != "delta" or not isinstance(base_id, str)
                                or not _IDENTITY.fullmatch(base_id)):
        raise FormatError(f"field 'base_id' must be 'sha256:<64 hex>' on a delta, got "
                          f"{str(base_id)[:80]!r} on a{'n' if kind == 'anchor' else ''} {kind}")
    resumed = doc.get("resumed_from")
    if resumed is not None and (problem := step_problem(resumed)) is not None:
        raise FormatError(f"field 'resumed_from' = {shown(resumed)} {problem}")
    adapter = doc.get("adapter")
    if adapter is not None:
        adapter = AdapterInfo.from_dict(adapter)
    return dict(step=step, kind=kind, base_step=base, anchor_step=anchor, created_at=float(created),
                fingerprint=fp, files=files, tensors=tensors, totals=totals,
                schema_version=version, run_id=run_id, writer=writer, requires=requires,
                base_id=base_id, resumed_from=resumed, adapter=adapter)


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


def _check_file_index(files: Sequence[FileEntry], tensors: Sequence[TensorEntry]) -> None:
    """Each file's index must be exactly the merged byte ranges of the chunks it holds."""
    expected = file_indexes(len(files), ((c.file, t.name, r.offset, r.length)
                                          for t in tensors for c in t.chunks
                                          for r in (c.roles or {}).values()))
    for f, index in zip(files, expected, strict=True):
        if dict(f.index or {}) != index:
            raise FormatError(f"the index of {f.path} does not match the byte ranges of its chunks")



def _chain_fields(doc: Mapping[str, Any], step: int) -> tuple[Kind, int | None, int]:
    kind = doc["kind"]
    anchor = _int(doc, "anchor_step", maximum=MAX_STEP)
    if kind == "anchor":
        if doc["base_step"] is not None or anchor != step:
            raise FormatError("an anchor has base_step null and anchor_step equal to its step")
        return "anchor", None, anchor
    if kind != "delta":
        raise FormatError(f"kind {kind!r} is neither 'anchor' nor 'delta'")
    base = _int(doc, "base_step", maximum=MAX_STEP)
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
            isinstance(r, list) and len(r) == 2 and all(is_int(x) and 0 <= x <= MAX_INT for x in r) for r in ranges
        ):
            raise FormatError(f"index of {path!r}: {name!r} must list [offset, length] pairs")
        index[name] = tuple((int(a), int(b)) for a, b in ranges)
    return FileEntry(path, size, sha, index)


def _tensor_from_dict(doc: Mapping[str, Any], sizes: Sequence[int], version: int,
                      requires: Any) -> TensorEntry:
    name = doc["name"]
    problem = name_problem(name)
    if problem is not None:
        raise FormatError(f"tensor {str(name)[:80]!r} {problem}")
    raw_shape = doc["shape"]
    problem = (shape_problem(raw_shape) if isinstance(raw_shape, list)
               else f"has a shape of type {type(raw_shape).__name__}, not a list")
    if problem is not None:
        raise FormatError(f"tensor {name!r} {problem}")
    shape = tuple(raw_shape)
    numel = math.prod(shape)
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
    if not isinstance(raw, list) or len(raw) not in (2, 4) or not all(is_int(x) and 0 <= x <= MAX_INT for x in raw):
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


__all__ = ["MAX_INT", "parse_manifest"]

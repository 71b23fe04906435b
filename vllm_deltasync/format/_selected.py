"""A manifest read for the tensors one reader selects (a rank's view of a step).

An expert-parallel rank of a 1T MoE reads ~3,000 of the step's ~70,000 tensors, but every
manifest lists them all: parsing and checking every chunk table costs seconds per rank
(benchmarks/manifest_1t.py). ``read_manifest(data, source=..., select=...)`` parses a format
v3 manifest's tensor table only where it must:

* the inflated table (a compact JSON array of tensor objects, as every writer of this package
  writes it) is split into its elements by one vectorized pass over its bytes (strings, escapes
  and nesting followed exactly); each element's fields other than ``chunks`` are read by one
  regular expression anchored at its start;
* every tensor's name, shape, dtype, encoding, codec version and changed count are checked as
  the full parser checks them; the step-wide rules (names listed once, ``totals.changed``, an
  anchor's tensor set against its fingerprint, §7) run on all of them;
* the selected tensors are parsed and checked in full (chunks, regions, roles, the coverage
  rule) by the full parser (``Manifest.from_json``) on the document reduced to them.

The chunk tables of the tensors not selected are not parsed: the rank never reads them, and
the ranks that do check them (every tensor of a model is read by some rank, so a step that
breaks a rule is refused by at least one rank and never switched to). Anything that is not of
that shape (format 1 or 2, another layout of the JSON, any defect) is read by the full parser,
which raises the error a defect deserves (its result then reduced to the selected tensors).
The result is a :class:`Manifest` whose ``tensors``
are the selected ones in table order, whose ``identity`` is that of the whole document, and
whose files have no index (what else a file holds is not known, so none is read whole: only
the selected chunks' byte ranges, each checked by its sha256). Not for re-serializing.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import gc
import json
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.codecs import CODECS
from vllm_deltasync.format.coverage import TableRow, check_manifest
from vllm_deltasync.format.manifest import (
    FORMAT_NAME,
    MAX_INT,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    MAX_NUMEL,
    TABLE_KEY,
    Manifest,
    TensorEntry,
    manifest_identity,
    merge_ranges,
)

_QUOTE, _OPEN, _CLOSE, _BACKSLASH = 1, 2, 3, 92
_CODES = bytes(_QUOTE if c == ord('"') else _OPEN if c in b"[{" else _CLOSE if c in b"]}" else 0
               for c in range(256))
"""``bytes.translate`` table: a quote, an opening and a closing bracket; 0 for the rest."""
_INT = rb"(0|[1-9][0-9]{0,15})"
_NAME_KEY = b'{"name":"'
_HEAD = re.compile(
    rb'\{"name":"([^"\\\x00-\x1f]*(?:\\.[^"\\\x00-\x1f]*)*)","shape":\[((?:0|[1-9][0-9]{0,15})(?:,(?:0|[1-9][0-9]{0,15}))*)?\],'
    rb'"dtype":"([^"\\\x00-\x1f]*)","encoding":"([^"\\\x00-\x1f]*)","codec_version":' + _INT
    + rb',"changed":' + _INT + rb',"chunks":\[')
"""The fields of a tensor object before its chunk table, in the order writers write them."""


def read_manifest(data: bytes, *, source: str, select: Callable[[str], bool] | None = None) -> Manifest:
    """Parse and check manifest bytes (format, chain fields, coverage rule): every tensor, or
    with ``select`` the selected tensors of a version 3 manifest (the module's docstring).
    :class:`FormatError` naming ``source`` on any defect."""
    with _gc_paused():
        return _read(data, source, select)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Parsing allocates ~10 objects per tensor, all alive until the manifest is built: the
    cyclic collector walks them again and again (half the parse time of a 70,000-tensor
    manifest). Reference counting frees everything as usual; the collector runs again after."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _read(data: bytes, source: str, select: Callable[[str], bool] | None) -> Manifest:
    table = None if select is None else _table(data)
    if select is None or table is None:
        m = Manifest.from_json(data, source=source)
        _check(m, None, source)
        return m if select is None else _view(m, tuple(t for t in m.tensors if select(t.name)))
    doc, text, (starts, ends), rows = table
    picked = np.array([i for i, row in enumerate(rows) if select(row.name)], dtype=np.int64)
    tensors = json.loads(b"[" + b",".join(text[s: e + 1] for s, e in zip(
        starts[picked].tolist(), ends[picked].tolist(), strict=True)) + b"]")
    reduced = {k: v for k, v in doc.items() if k != TABLE_KEY}
    reduced["schema_version"] = 2  # version 3 is version 2 with the table deflated (§4.1)
    reduced["tensors"] = tensors
    reduced["files"] = _with_index(doc["files"], tensors)
    m = Manifest.from_json(json.dumps(reduced, separators=(",", ":")).encode(), source=source)
    m = _view(replace(m, schema_version=3, identity=manifest_identity(data)), m.tensors)
    _check(m, rows, source)
    return m


def _view(m: Manifest, tensors: tuple[TensorEntry, ...]) -> Manifest:
    """``m`` listing ``tensors`` only; its files without an index (what else they hold is
    not listed, so none is read whole)."""
    return replace(m, tensors=tensors, files=tuple(replace(f, index=None) for f in m.files))


def _check(m: Manifest, table: Sequence[TableRow] | None, source: str) -> None:
    try:
        check_manifest(m, table)
    except FormatError as exc:
        raise FormatError(f"{source}: {exc}") from exc


_Table = tuple[dict[str, Any], bytes, tuple[np.ndarray, np.ndarray], list[TableRow]]


def _table(data: bytes) -> _Table | None:
    """The document, its inflated tensor table, each tensor's span in it and its fields but
    the chunks, or None when ``data`` is not a well-formed v3 manifest of the usual shape (the
    full parser then reads it, and names any defect)."""
    if len(data) > MAX_MANIFEST_BYTES or TABLE_KEY.encode() not in data:
        return None
    try:
        doc = json.loads(bytes(data).decode("utf-8"), parse_constant=_no_constant)
        if not (isinstance(doc, dict) and doc.get("schema_version") == 3
                and doc.get("format") == FORMAT_NAME and isinstance(doc.get("files"), list)
                and all(isinstance(f, dict) and "index" not in f for f in doc["files"])):
            return None
        text = _inflate(doc.get(TABLE_KEY))
        spans = None if text is None else split_table(text)
        if text is None or spans is None:
            return None
        rows = _rows(text, spans[0])
    except (ValueError, RecursionError):  # not UTF-8, not JSON
        return None
    if rows is None:
        return None
    return doc, text, spans, rows


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _inflate(raw: Any) -> bytes | None:
    """The inflated tensor table under the limits of §4.1, or None."""
    if not isinstance(raw, str):
        return None
    try:
        deflated = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        return None
    inflater = zlib.decompressobj()
    try:
        table = inflater.decompress(deflated, MAX_MANIFEST_BYTES)
    except zlib.error:
        return None
    if inflater.unconsumed_tail or not inflater.eof or inflater.unused_data:
        return None
    if not table.isascii():
        table.decode("utf-8")  # strict, as the full parser: UnicodeDecodeError is a ValueError
    return table


def split_table(text: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """The first and last byte of each element of ``text``, a tensor table in compact JSON
    (``[{...},{...}]``, nothing between the elements but a comma; in each element exactly two
    fields are arrays or objects and the last field is an array: the shape and the chunks),
    or None when ``text`` is not of that shape or its quotes and brackets do not balance.
    Strings (escapes included) and nesting are followed exactly; what lies inside an element
    is not otherwise checked."""
    a = np.frombuffer(text, np.uint8)
    if text == b"[]":
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if a.size < 4 or text[:2] != b"[{" or text[-2:] != b"}]":
        return None
    codes = np.frombuffer(text.translate(_CODES), np.uint8)
    pos = np.flatnonzero(codes.view(np.bool_))
    kind = codes[pos]
    quote = kind == _QUOTE
    if text.find(b"\\") >= 0:
        quote &= ~_escaped(a, pos)
    inside = np.cumsum(quote, dtype=np.int64) & 1  # after a quote: 1 inside a string
    if inside.size and inside[-1]:
        return None  # a string never closed
    bracket = (kind != _QUOTE) & (inside == 0)
    where, kind = pos[bracket], kind[bracket]
    depth = np.cumsum(np.where(kind == _OPEN, 1, -1), dtype=np.int64)  # after each bracket
    if depth[-1] != 0 or depth[:-1].min(initial=1) < 1:
        return None
    starts = where[(kind == _OPEN) & (depth == 2)]
    ends = where[(kind == _CLOSE) & (depth == 1)]
    if (starts.size != ends.size or (a[starts] != ord("{")).any() or (a[ends] != ord("}")).any()
            or starts[0] != 1 or ends[-1] != a.size - 2 or (starts[1:] != ends[:-1] + 2).any()
            or (a[ends[:-1] + 1] != ord(",")).any()):
        return None
    inner = where[(kind == _OPEN) & (depth == 3)]  # arrays and objects that are a tensor's fields
    counts = np.searchsorted(inner, ends) - np.searchsorted(inner, starts)
    if (counts != 2).any() or (a[ends - 1] != ord("]")).any():
        return None  # a tensor is exactly its shape array, its chunks array (last) and scalars
    return starts, ends


def _escaped(a: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """For each structural byte at ``pos``: is it preceded by an odd run of backslashes?"""
    slashes = np.flatnonzero(a == _BACKSLASH)
    out = np.zeros(pos.size, dtype=bool)
    after = np.flatnonzero(a[np.maximum(pos - 1, 0)] == _BACKSLASH)
    if after.size:
        breaks = np.flatnonzero(np.diff(slashes) != 1) + 1
        first = np.zeros(slashes.size, np.int64)
        first[breaks] = breaks
        first = np.maximum.accumulate(first)
        run_start = slashes[first]
        k = np.searchsorted(slashes, pos[after] - 1)
        out[after] = ((pos[after] - 1 - run_start[k] + 1) & 1).astype(bool)
    return out


def _rows(text: bytes, starts: np.ndarray) -> list[TableRow] | None:
    """Each tensor's fields but its chunks, checked as the full parser checks them, or None.

    Every element starts with ``{"name":"`` and nothing else in the table does, so the
    matches of ``_HEAD`` (which begin so) are the elements' heads, one each, in order."""
    prefix = np.frombuffer(_NAME_KEY, np.uint8)
    a = np.frombuffer(text, np.uint8)
    heads = _HEAD.findall(text)
    if (len(heads) != starts.size or text.count(_NAME_KEY) != starts.size
            or not (a[starts[:, None] + np.arange(prefix.size)] == prefix).all()):
        return None
    if not heads:
        return []
    raw_names, raw_shapes, dtypes, encodings, versions, changed_raw = zip(*heads, strict=True)
    known = {name.encode(): codec.version for name, codec in CODECS.items()}
    if set(dtypes) != {b"bfloat16"} or any(
            not 1 <= int(v) <= known.get(e, 0) for e, v in set(zip(encodings, versions, strict=True))):
        return None  # another dtype, an unknown codec or version: the full parser says which
    shapes = {raw: _shape(raw) for raw in set(raw_shapes)}
    limits = [numel for _, numel in shapes.values()]
    names = _names(text, raw_names)
    if names is None or None in limits or len(set(names)) != len(names):
        return None
    changed = list(map(int, changed_raw))
    numels = [shapes[raw][1] or 0 for raw in raw_shapes]
    if any(c > n for c, n in zip(changed, numels, strict=True)):
        return None
    return list(map(TableRow._make, zip(
        names, [shapes[raw][0] for raw in raw_shapes], ["bfloat16"] * len(names),
        [e.decode() for e in encodings], changed, numels, strict=True)))


def _names(text: bytes, raw: Sequence[bytes]) -> list[str] | None:
    """The tensor names (1 to 1024 characters, no NUL), or None."""
    if text.find(b"\\") < 0:  # plain UTF-8: the pattern refused control characters
        names = [r.decode() for r in raw]
    else:
        names = [json.loads(b'"' + r + b'"') if b"\\" in r else r.decode() for r in raw]
        if any(not isinstance(n, str) or "\x00" in n for n in names):
            return None
    if names and (min(map(len, names)) < 1 or max(map(len, names)) > 1024):
        return None
    return names


def _shape(raw: bytes) -> tuple[tuple[int, ...], int | None]:
    """The dimensions and element count of a shape's digits (count None: over the limits)."""
    dims = tuple(int(d) for d in raw.split(b",")) if raw else ()
    n = 1
    for d in dims:
        n *= d
    ok = len(dims) <= MAX_NDIM and all(d <= MAX_INT for d in dims) and n <= MAX_NUMEL
    return dims, n if ok else None


def _with_index(files: list[dict[str, Any]], tensors: list[Any]) -> list[dict[str, Any]]:
    """The files with the index their selected chunks define (§4.1: a reader rebuilds it)."""
    ranges: list[dict[str, list[tuple[int, int]]]] = [{} for _ in files]
    for t in tensors:  # malformed entries are skipped here; the parser names them
        for c in (t.get("chunks") or ()) if isinstance(t, dict) else ():
            file, roles = (c.get("file"), c.get("roles")) if isinstance(c, dict) else (None, None)
            if type(file) is not int or not 0 <= file < len(files) or not isinstance(roles, dict):
                continue
            for r in roles.values():
                if isinstance(r, dict) and type(r.get("offset")) is int and type(r.get("length")) is int:
                    ranges[file].setdefault(str(t.get("name")), []).append((r["offset"], r["length"]))
    return [{**f, "index": {n: [list(r) for r in merge_ranges(rs)] for n, rs in found.items()}}
            for f, found in zip(files, ranges, strict=True)]


__all__ = ["read_manifest", "split_table"]

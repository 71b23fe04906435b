"""sparse-v3, reading: what a chunk's meta and body may be, and the two decoders.

The layout is specified in :mod:`vllm_deltasync.format.sparse_v3` (and docs/codec.md). Every
meta field is range-checked before anything is sized by it; the body is decompressed only
after its declared size matches the meta's. ``decode`` runs the numba kernel ``_fused`` where
the codec hands one in, else ``_decode_numpy``: the same output, or the same error.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vllm_deltasync.errors import ConfigError, FormatError

MAX_INDEX = (1 << 40) - 1
"""Largest local index (a tensor has at most 2**40 elements), so a high part fits uint32."""
MAX_SPAN_PER_ELEMENT = 16
"""The ``span`` layout is used (and accepted) only for ``span <= 16 * count + 16``."""

ZSTD_CONTEXTS = threading.local()
"""Per thread: zstd compressor and decompressor contexts (not thread-safe themselves)."""


def zstd_module() -> Any:
    """The zstandard package (imported at first use; ConfigError saying how to install it)."""
    try:
        import zstandard
    except ImportError:
        raise ConfigError("sparse-v3 needs zstandard (a dependency of vllm-deltasync>=0.3.0): "
                          "`pip install zstandard`") from None
    return zstandard


def _decompress(frame: np.ndarray, size: int) -> bytes:
    zstd = zstd_module()
    try:
        declared = zstd.frame_content_size(frame)
    except zstd.ZstdError as exc:
        raise FormatError(f"sparse-v3: the zstd frame header is corrupt ({exc})") from exc
    if declared != size:  # a decompressor allocates what the header says: refuse first
        raise FormatError(f"sparse-v3: the zstd frame says {declared} bytes, the chunk meta "
                          f"{size}; refused before decompressing")
    dctx = getattr(ZSTD_CONTEXTS, "d", None)
    if dctx is None:
        dctx = ZSTD_CONTEXTS.d = zstd.ZstdDecompressor()
    try:
        raw = dctx.decompress(frame, max_output_size=max(size, 1))
    except zstd.ZstdError as exc:
        raise FormatError(f"sparse-v3: the zstd frame is corrupt ({exc})") from exc
    if len(raw) != size:
        raise FormatError(f"sparse-v3: {len(raw)} bytes after decompression, expected {size}")
    return bytes(raw)


def body_size(meta: Mapping[str, Any], count: int) -> int:
    """Exact body size the meta and ``count`` imply (meta already range-checked)."""
    if meta["layout"] == "span":
        return 2 * int(meta["span"])
    hb = int(meta["high_bits"])
    values = 2 * count if hb == 8 else 2 * int(meta["value_escapes"])
    return 4 * int(meta["high_escapes"]) + values + 2 * count


def _meta_int(meta: Mapping[str, Any], key: str, low: int, high: int) -> int:
    """An integer field of the chunk meta, checked to lie in ``[low, high]`` before use."""
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise FormatError(f"sparse-v3 chunk meta: {key}={str(value)[:40]} is not an integer in "
                          f"[{low}, {high}]")
    return value


def _meta_choice(meta: Mapping[str, Any], key: str, choices: tuple[Any, ...]) -> Any:
    value = meta[key]
    if isinstance(value, bool) or value not in choices:
        raise FormatError(f"sparse-v3 chunk meta: {key}={str(value)[:40]!r} is not one of {choices}")
    return value


def _checked_meta(meta: Mapping[str, Any], count: int) -> None:
    layout = _meta_choice(meta, "layout", ("gaps", "span"))
    mode = _meta_choice(meta, "values", ("diff", "raw"))
    _meta_choice(meta, "compression", ("none", "zstd"))
    _meta_int(meta, "first", 0, MAX_INDEX)
    if layout == "span":
        if mode != "diff":
            raise FormatError("sparse-v3 chunk meta: the span layout holds differences only")
        _meta_int(meta, "span", count, MAX_SPAN_PER_ELEMENT * (count + 1))
        return
    hb = _meta_int(meta, "high_bits", 1, 8)
    _meta_int(meta, "high_escapes", 0, count)
    _meta_int(meta, "value_escapes", 0, count if hb < 8 else 0)
    if mode == "raw" and hb != 8:
        raise FormatError("sparse-v3 chunk meta: raw values need high_bits 8")


def _body(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], size: int) -> np.ndarray:
    data = tensors.get("data")
    if data is None or data.dtype != torch.uint8 or data.dim() != 1:
        raise FormatError("sparse-v3: role 'data' (uint8, 1-D) is missing or malformed")
    if len(tensors) != 1:
        raise FormatError(f"sparse-v3: unexpected roles {sorted(tensors)}")
    arr = data.cpu().numpy()
    if meta["compression"] == "none":
        if arr.size != size:
            raise FormatError(f"sparse-v3: role 'data' has {arr.size} bytes, the meta implies {size}")
        return _readonly(arr)  # as a decompressed body is: one compiled kernel serves both
    return np.frombuffer(_decompress(arr, size), dtype=np.uint8)


def _readonly(arr: np.ndarray) -> np.ndarray:
    view = arr.view()
    view.flags.writeable = False
    return view


def _value_fields(fields: np.ndarray, hb: int) -> np.ndarray:
    """int16 differences of the value fields (the top ``8 - hb`` bits of each field byte).

    ``d = unzigzag(c + 1)`` in uint8/int8 arithmetic (``c + 1 <= 128``, ``|d| <= 64``), then
    widened once: ~2.5x faster than a table lookup (numpy's take widens the indices first).
    """
    zz = fields >> np.uint8(hb)
    zz += np.uint8(1)
    sign = (zz & np.uint8(1)).view(np.int8)
    np.negative(sign, out=sign)
    zz >>= np.uint8(1)
    d = zz.view(np.int8)
    d ^= sign
    return d.astype(np.int16)


def decode(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], count: int, kernel: Any
           ) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
    """One chunk's (indices, values, relative); ``kernel``: ``_fused`` compiled by numba, or
    None for the numpy passes. FormatError on any defect (a malformed meta too)."""
    try:
        return _decode(tensors, meta, count, kernel)
    except (KeyError, TypeError, ValueError, OverflowError, IndexError) as exc:
        raise FormatError(f"sparse-v3 chunk meta is incomplete or malformed "
                          f"({type(exc).__name__}: {str(exc)[:200]})") from None


def _decode(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], count: int, kernel: Any
            ) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
    _checked_meta(meta, count)
    body = _body(tensors, meta, body_size(meta, count))
    first = int(meta["first"])
    raw = meta["values"] == "raw"
    if count == 0:
        return (torch.empty(0, dtype=torch.int64),
                torch.empty(0, dtype=torch.bfloat16 if raw else torch.int16), not raw)
    if meta["layout"] == "span":
        diff = body.view("<i2")
        nz = np.flatnonzero(diff)
        if nz.size != count:
            raise FormatError(f"sparse-v3: the span holds {nz.size} changed elements, count is {count}")
        changed = diff[nz]
        if first:
            nz += first
        return torch.from_numpy(nz), torch.from_numpy(changed), True
    n, hb = count, int(meta["high_bits"])
    he, ve = int(meta["high_escapes"]), int(meta["value_escapes"])
    pos = 0

    def take(nbytes: int) -> np.ndarray:
        nonlocal pos
        part = body[pos : pos + nbytes]
        pos += nbytes
        return part

    high_over = take(4 * he).view("<u4")
    values16 = take(2 * n).view("<i2") if hb == 8 else None
    value_over = take(2 * ve).view("<i2")
    low, fields = take(n), take(n)
    if kernel is not None:
        indices = np.empty(n, np.int64)
        values = values16.copy() if values16 is not None else np.empty(n, np.int16)
        seen_h, seen_v = kernel(low, fields, high_over, value_over, hb, first, indices, values,
                                values16 is None)
        _check_escapes(seen_h, he, seen_v, ve)
        out = torch.from_numpy(indices)
    else:
        out, values = _decode_numpy(low, fields, high_over, value_over, values16, hb, first)
    if raw:
        return out, torch.from_numpy(values).view(torch.bfloat16), False
    return out, torch.from_numpy(values), True


def _check_escapes(seen_h: int, he: int, seen_v: int, ve: int) -> None:
    if seen_h != he:  # sparse-v2's rule: escapes are counted where an overflow exists
        raise FormatError(f"sparse-v3: {seen_h} escaped high fields, meta says {he}")
    if seen_v != ve:
        raise FormatError(f"sparse-v3: {seen_v} escaped values, meta says {ve}")


def _decode_numpy(low: np.ndarray, fields: np.ndarray, high_over: np.ndarray,
                  value_over: np.ndarray, values16: np.ndarray | None, hb: int, first: int
                  ) -> tuple[torch.Tensor, np.ndarray]:
    """The ``gaps`` layout's fields to (indices, values) in numpy and torch passes (without numba)."""
    mask = (1 << hb) - 1
    g16 = np.bitwise_and(fields, np.uint8(mask)).astype(np.uint16)  # gap = low | field << 8,
    g16 <<= 8                                                          # built in uint16, then
    g16 |= low                                                         # widened once
    gaps = g16.astype(np.int64)
    where_h = np.flatnonzero(np.bitwise_and(fields, np.uint8(mask)) == mask) if high_over.size else ()
    where_v = (np.flatnonzero(fields >= np.uint8(((1 << (8 - hb)) - 1) << hb))
               if values16 is None and value_over.size else ())
    _check_escapes(len(where_h), high_over.size, len(where_v), value_over.size)
    if high_over.size:
        gaps[where_h] += high_over.astype(np.int64) << 8
    if values16 is not None:
        values = values16.copy()
    else:
        values = _value_fields(fields, hb)
        if value_over.size:  # escape value fields are the top ones: c field = 2**(8 - hb) - 1
            values[where_v] = value_over
    gaps[0] = first  # gap[0] is 0 by construction
    indices = torch.from_numpy(gaps)
    torch.cumsum(indices, 0, out=indices)  # ~4x faster than numpy's cumsum here
    return indices, values


def _fused(low, fields, high_over, value_over, hb, first, indices, values, coded):  # type: ignore[no-untyped-def]
    """The ``gaps`` layout's fields to ``indices`` (and, if ``coded``, the value codes to
    ``values``) in one pass; returns the escaped high and value fields seen. Compiled by numba
    (``_kernel``): ~1.1 ns per element against ~3 for the numpy passes of ``_decode_numpy``.
    Overflow reads stop at the sections' ends; the caller compares the counts with the meta.
    As in sparse-v2 (and ``_decode_numpy``), escapes are looked for only where their overflow
    section is non-empty."""
    n = low.size
    mask = np.uint8((1 << hb) - 1)
    nh, nv = high_over.size, value_over.size
    seen_h = 0
    if nh and n and (fields[0] & mask) == mask:  # gap[0] is 0 by construction: counted only
        seen_h = 1
    acc = np.int64(first)
    if n:
        indices[0] = acc
    for k in range(1, n):
        h = fields[k] & mask
        g = np.int64(low[k]) | (np.int64(h) << 8)
        if nh and h == mask:
            if seen_h < nh:
                g += np.int64(high_over[seen_h]) << 8
            seen_h += 1
        acc += g
        indices[k] = acc
    seen_v = 0
    if coded:
        for k in range(n):  # d = unzigzag(c + 1), branch-free; escapes patched below
            zz = np.int16((fields[k] >> hb) + 1)
            values[k] = (zz >> 1) ^ -(zz & 1)
    if coded and nv:
        top = np.uint8((1 << (8 - hb)) - 1)
        for k in range(n):
            if (fields[k] >> hb) == top:
                if seen_v < nv:
                    values[k] = value_over[seen_v]
                seen_v += 1
    return seen_h, seen_v


__all__ = ["MAX_INDEX", "MAX_SPAN_PER_ELEMENT", "body_size", "decode", "zstd_module"]

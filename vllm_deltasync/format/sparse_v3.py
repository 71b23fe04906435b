"""``sparse-v3``: entropy-coded deltas, ~1.1-1.3 bytes per changed element (docs/codec.md).

One chunk of ``n`` changed elements is one role, ``data`` (uint8): a *body* of byte-aligned
sections, stored as is (``meta["compression"] = "none"``) or as one zstd frame in which every
section starts a new block, so each gets its own Huffman table (``"zstd"``), whichever is
smaller. Two layouts (``meta["layout"]``):

``"gaps"`` (sparse). Gaps ``g[0] = 0``, ``g[k] = i[k] - i[k-1]``, ``meta["first"] = i[0]``.
Each gap is split into its low byte and its high part ``h = g >> 8``; each value into the code
``c = (zigzag(d) - 1) mod 2**16`` of ``d = (new_bits - old_bits) mod 2**16`` (``c = 0, 1, 2, 3``
for ``d = -1, +1, -2, +2``; ``d = 0`` is 65535). One *field byte* per element holds both, with
``hb = meta["high_bits"]`` (1-7) bits of ``min(h, 2**hb - 1)`` and ``8 - hb`` bits of
``min(c, 2**(8 - hb) - 1)`` above them; all-ones = escape, the true value follows in an
overflow section, in element order. ``hb = 8``: the byte is ``min(h, 255)`` only and the
values are int16 (``values16``). Body, widest sections first, little-endian::

    high_overflow   uint32 x high_escapes    h - (2**hb - 1) of each escaped high field
    values16        int16 x n                hb = 8 only: d (or the raw bf16 bits)
    value_overflow  int16 x value_escapes    hb < 8: d of each escaped value field
    low             uint8 x n                g & 0xFF
    fields          uint8 x n                the field bytes

Merging the two fields keeps zstd's byte-wise Huffman stage off its 1 bit per byte floor
(the high part alone carries ~0.3 bits at 1% density).

``"span"`` (dense fallback, chosen where smaller): ``int16 x meta["span"]``: ``d`` of every
local index ``first .. first + span - 1``, 0 where unchanged; the changed elements are the
non-zero ones (used only when every given ``d`` is non-zero, and ``span <= 16 * n + 16``).
It is never larger than the dense bf16 size of the span.

``meta["values"] = "raw"`` (encoder given no base values): ``values16`` holds the absolute
bf16 bits, ``high_bits`` is 8, no ``span`` layout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vllm_deltasync._jit import LOCK, compile_kernels, first, once
from vllm_deltasync.errors import ConfigError, FormatError
from vllm_deltasync.format.codec import Codec

ZSTD_LEVEL = 15
MAX_INDEX = (1 << 40) - 1
"""Largest local index (a tensor has at most 2**40 elements), so a high part fits uint32."""
MAX_SPAN_PER_ELEMENT = 16
"""The ``span`` layout is used (and accepted) only for ``span <= 16 * count + 16``."""
_SMALL = 256
"""Chunks of fewer elements choose field widths by raw size (zstd would not pay off)."""

logger = logging.getLogger(__name__)


def _zigzag_code(d: np.ndarray) -> np.ndarray:
    """int16 d -> uint16 c = (zigzag(d) - 1) mod 2**16: -1, 1, -2, 2, ... -> 0, 1, 2, 3; 0 -> 65535."""
    zz = ((d << 1) ^ (d >> 15)).view(np.uint16)
    return zz - np.uint16(1)


def _unzigzag_code(c: np.ndarray) -> np.ndarray:
    zz = (c.astype(np.int64) + 1) & 0xFFFF
    return ((zz >> 1) ^ -(zz & 1)).astype(np.int16)


_BYTES = np.arange(256, dtype=np.int64)
_VALUE_LUT = {hb: _unzigzag_code(_BYTES >> hb) for hb in range(1, 8)}
"""field byte -> its int16 difference (an escape: the difference its code stands for)."""


def _entropy_bits(hist: np.ndarray) -> float:
    p = hist[hist > 0] / hist.sum()
    return float(-(p * np.log2(p)).sum())


def _joint_histogram(high: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """int64 counts of (min(h, 255), min(c, 255)), 256 x 256 (numpy; ``_enc_scan`` in numba)."""
    key = np.minimum(high, 255)
    key <<= 8
    key += np.minimum(codes, 255)
    return np.bincount(key, minlength=65536).reshape(256, 256)


def _choose_high_bits(joint: np.ndarray, n: int, used: tuple[int, int] | None = None,
                      tables_kernel: Any = None) -> int:
    """``high_bits`` with the smallest estimated size, from the joint histogram ``joint`` of
    (min(h, 255), min(c, 255)) of the ``n`` elements.

    Estimate: zstd's Huffman stage codes bytes, at least 1 bit each, so a field byte costs
    ``max(entropy of the field bytes, 1)`` bits (+2% for tables); a high escape ~3 bytes, a value
    escape ~1.5 (their overflow compresses). Small chunks (not worth compressing) are sized raw.
    ``used``: (rows, columns) of ``joint`` that may be non-zero, where the caller knows them.
    ``tables_kernel``: ``_field_tables`` compiled by numba (None: numpy).

    Every candidate's field bytes have exactly 256 values (``2**hb`` high fields x ``2**(8-hb)``
    value fields), so one (8, 256) table of exact integer counts (``_field_tables``: numba, or
    numpy) holds them all, and one vectorized pass over it sizes them: the same integers give
    the same floats whichever built them and whatever ``used`` said, so both encoders choose
    alike, with a fixed cost of a few numpy calls per chunk (it was ~0.3 ms: small tensors paid
    it per element).
    """
    if used is None:
        nz = np.flatnonzero(joint.reshape(-1))
        used = (int(nz[-1]) // 256 + 1, int((nz & 255).max()) + 1) if nz.size else (1, 1)
    tables = np.zeros((8, 256), np.int64)
    escapes = np.zeros((8, 2), np.int64)
    if tables_kernel is not None:
        tables_kernel(np.ascontiguousarray(joint).reshape(-1), used[0], used[1], tables, escapes)
    else:
        _field_tables_numpy(joint[: used[0], : used[1]], tables, escapes)
    he, ve = escapes[:, 0].astype(np.float64), escapes[:, 1].astype(np.float64)
    if n < _SMALL:
        costs = n + 4 * he + 2 * ve
        costs[0] = 3.0 * n + 4 * he[0]
    else:
        counts = tables.astype(np.float64)
        p = counts / counts.sum(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(counts > 0, p * np.log2(np.where(counts > 0, p, 1.0)), 0.0)
        bits = np.maximum(-terms.sum(axis=1), 1.0) + 0.02
        costs = n * bits / 8 + 3 * he + 1.5 * ve
        costs[0] = n * bits[0] / 8 + 1.9 * n + 4 * he[0]
    order = (8, 1, 2, 3, 4, 5, 6, 7)  # row 0 is hb = 8; ties go to the smaller hb
    return order[min(range(8), key=lambda r: (float(costs[r]), order[r]))]


def _field_tables(joint, rows, cols, tables, escapes):  # type: ignore[no-untyped-def]
    """Counts of every candidate's field bytes from the joint histogram's used corner (numba;
    ``_field_tables_numpy`` is the same in numpy): row 0 is ``hb = 8`` (the high parts, the
    last one the escapes'), row ``hb`` the fields ``min(h, 2**hb - 1) | min(c, 2**(8-hb) - 1)
    << hb`` in (h, c) order; ``escapes[r]``: (high escapes, value escapes)."""
    for r in range(rows):
        for c in range(cols):
            v = joint[r * 256 + c]
            if v == 0:
                continue
            tables[0, r] += v
            if r == 255:
                escapes[0, 0] += v
            for hb in range(1, 8):
                hm = (1 << hb) - 1
                vm = (1 << (8 - hb)) - 1
                rr = r if r < hm else hm
                cc = c if c < vm else vm
                tables[hb, rr * (vm + 1) + cc] += v
                if r >= hm:
                    escapes[hb, 0] += v
                if c >= vm:
                    escapes[hb, 1] += v


def _field_tables_numpy(joint: np.ndarray, tables: np.ndarray, escapes: np.ndarray) -> None:
    rows, cols = joint.shape
    r_idx, c_idx = np.arange(rows)[:, None], np.arange(cols)[None, :]
    tables[0, :rows] = joint.sum(axis=1)
    escapes[0, 0] = joint[255].sum() if rows == 256 else 0
    for hb in range(1, 8):
        hm, vm = (1 << hb) - 1, (1 << (8 - hb)) - 1
        cell = np.minimum(r_idx, hm) * (vm + 1) + np.minimum(c_idx, vm)
        np.add.at(tables[hb], cell.reshape(-1), joint.reshape(-1))
        escapes[hb, 0] = joint[hm:].sum()
        escapes[hb, 1] = joint[:, vm:].sum()


_LOCAL = threading.local()


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ConfigError("sparse-v3 needs zstandard (a dependency of vllm-deltasync>=0.3.0): "
                          "`pip install zstandard`") from None
    return zstandard


def _compress(sections: list[bytes], level: int) -> bytes:
    """One zstd frame of the sections, each section starting a new block (so each gets its own
    Huffman table: a low-byte plane and a skewed field plane in one block would share one).

    zstd's fast parser with a 64-entry hash table and 7-byte matches: the sections hold almost no
    repeats, so the frame is essentially Huffman-coded literals, and matches found by a larger
    table or a deeper search cost more than the literals they replace. ~4 ns per changed element
    (btopt, used up to 0.4.0: ~75 ns) at ~0.2% fewer bytes. ``level`` fills the parameters not
    set here (none that change the output today)."""
    zstd = _zstd()
    key = f"c{level}"
    cctx = getattr(_LOCAL, key, None)
    if cctx is None:
        params = zstd.ZstdCompressionParameters.from_level(
            level, window_log=17, chain_log=12, hash_log=6, search_log=1, min_match=7,
            target_length=0, strategy=zstd.STRATEGY_FAST, write_content_size=1, write_checksum=0)
        cctx = zstd.ZstdCompressor(compression_params=params)
        setattr(_LOCAL, key, cctx)
    obj = cctx.compressobj(size=sum(len(s) for s in sections))
    out = []
    for section in sections:
        if section:
            out.append(obj.compress(section))
            out.append(obj.flush(zstd.COMPRESSOBJ_FLUSH_BLOCK))
    out.append(obj.flush(zstd.COMPRESSOBJ_FLUSH_FINISH))
    return b"".join(out)


def _decompress(frame: np.ndarray, size: int) -> bytes:
    zstd = _zstd()
    try:
        declared = zstd.frame_content_size(frame)
    except zstd.ZstdError as exc:
        raise FormatError(f"sparse-v3: the zstd frame header is corrupt ({exc})") from exc
    if declared != size:  # a decompressor allocates what the header says: refuse first
        raise FormatError(f"sparse-v3: the zstd frame says {declared} bytes, the chunk meta "
                          f"{size}; refused before decompressing")
    dctx = getattr(_LOCAL, "d", None)
    if dctx is None:
        dctx = _LOCAL.d = zstd.ZstdDecompressor()
    try:
        raw = dctx.decompress(frame, max_output_size=max(size, 1))
    except zstd.ZstdError as exc:
        raise FormatError(f"sparse-v3: the zstd frame is corrupt ({exc})") from exc
    if len(raw) != size:
        raise FormatError(f"sparse-v3: {len(raw)} bytes after decompression, expected {size}")
    return bytes(raw)


# --------------------------------------------------------------------------------------------
# encode


def _gaps_body(idx: np.ndarray, values16: np.ndarray, coded: bool, meta: dict[str, Any]) -> list[bytes]:
    """Sections of the ``gaps`` layout (``values16``: differences if ``coded``, else raw bits);
    fills ``meta``. The numba kernels (``_enc_scan``, ``_enc_fields``) where present, else numpy
    passes (``_gaps_numpy``): the same bytes."""
    n = idx.size
    kernels = _encode_kernels()
    if kernels is None:
        hb, high_over, low, fields, value_over = _gaps_numpy(idx, values16, coded)
    else:
        scan, build, tables = kernels
        if coded:
            joint = np.zeros(65536, np.int64)
            used = scan(idx, values16, joint)
            hb = _choose_high_bits(joint.reshape(256, 256), n, (int(used[0]) + 1, int(used[1]) + 1),
                                   tables)
        else:
            hb = 8
        low, fields = np.empty(n, np.uint8), np.empty(n, np.uint8)
        high_over, value_over = np.empty(n, "<u4"), np.empty(n if hb < 8 else 0, "<i2")
        he, ve = build(idx, values16, hb, low, fields, high_over, value_over)
        high_over, value_over = high_over[:he], value_over[:ve]
    if hb == 8:
        sections = [high_over.tobytes(), values16.astype("<i2", copy=False).tobytes(), b""]
    else:
        sections = [high_over.tobytes(), b"", value_over.tobytes()]
    meta.update(high_bits=hb, high_escapes=int(high_over.size), value_escapes=int(value_over.size))
    return [*sections, low.tobytes(), fields.tobytes()]


def _gaps_numpy(idx: np.ndarray, values16: np.ndarray, coded: bool
                ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(high_bits, high overflow, low bytes, field bytes, value overflow) in numpy passes."""
    n = idx.size
    gaps = np.empty(n, np.int64)
    gaps[:1] = 0
    np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    low = (gaps & 0xFF).astype(np.uint8)
    high = gaps >> 8
    codes = _zigzag_code(values16) if coded else None
    hb = 8 if codes is None else _choose_high_bits(_joint_histogram(high, codes), n)
    hm = (1 << hb) - 1
    hbig = high >= hm
    high_over = (high[hbig] - hm).astype("<u4")
    fields = np.minimum(high, hm).astype(np.uint8)
    value_over = np.empty(0, "<i2")
    if hb < 8:
        assert codes is not None
        vm = (1 << (8 - hb)) - 1
        vbig = codes >= vm
        fields |= (np.minimum(codes, vm).astype(np.uint8) << np.uint8(hb))
        value_over = values16[vbig].astype("<i2")
    return hb, high_over, low, fields, value_over


def _enc_scan(idx, values16, joint):  # type: ignore[no-untyped-def]
    """Adds the (min(h, 255), min(c, 255)) pairs of the gaps' high parts and the differences'
    codes to ``joint`` (65536 int64), as ``_joint_histogram``; returns the largest of each.
    Compiled by numba."""
    n = idx.size
    prev = idx[0] if n else 0
    hmax: Any = 0
    cmax: Any = 0
    for k in range(n):
        g = idx[k] - prev
        prev = idx[k]
        h = g >> 8
        if h > 255:
            h = 255
        d: Any = np.int32(values16[k])
        c = ((((d << 1) ^ (d >> 15)) & 0xFFFF) - 1) & 0xFFFF
        if c > 255:
            c = 255
        joint[(h << 8) | c] += 1
        if h > hmax:
            hmax = h
        if c > cmax:
            cmax = c
    return hmax, cmax


def _enc_fields(idx, values16, hb, low, fields, high_over, value_over):  # type: ignore[no-untyped-def]
    """The ``gaps`` layout's sections of one chunk in one pass, as ``_gaps_numpy``: fills ``low``
    and ``fields``, the first escapes of ``high_over`` and (``hb < 8``) ``value_over``; returns
    their counts. Compiled by numba (``_encode_kernels``)."""
    n = idx.size
    hm = (1 << hb) - 1
    vm = (1 << (8 - hb)) - 1
    prev = idx[0] if n else 0
    he = 0
    ve = 0
    for k in range(n):
        g = idx[k] - prev
        prev = idx[k]
        low[k] = g & 0xFF
        h = g >> 8
        if h >= hm:
            high_over[he] = h - hm
            he += 1
            h = hm
        f = h
        if hb < 8:
            d = np.int32(values16[k])
            c = ((((d << 1) ^ (d >> 15)) & 0xFFFF) - 1) & 0xFFFF
            if c >= vm:
                value_over[ve] = values16[k]
                ve += 1
                c = vm
            f |= c << hb
        fields[k] = f
    return he, ve


def _body_size(meta: Mapping[str, Any], count: int) -> int:
    """Exact body size the meta and ``count`` imply (meta already range-checked)."""
    if meta["layout"] == "span":
        return 2 * int(meta["span"])
    hb = int(meta["high_bits"])
    values = 2 * count if hb == 8 else 2 * int(meta["value_escapes"])
    return 4 * int(meta["high_escapes"]) + values + 2 * count


class SparseV3Codec(Codec):
    """Gap low bytes plus merged (high part, value code) field bytes, in one zstd frame."""

    name = "sparse-v3"
    relative = True
    max_bytes_per_element = 6
    """Sizes chunks like sparse-v1; encoded chunks are ~5x smaller than this bound."""
    min_reader = "0.3.0"

    def __init__(self, *, level: int = ZSTD_LEVEL) -> None:
        """``level``: zstd level whose parameters fill those ``_compress`` does not set (zstd's
        fast parser, a 64-entry hash table, 7-byte minimum matches; the output is the same at
        every level today). Kept for compatibility: 0.4.0 used the level's optimal parser."""
        self.level = level

    def encode(
        self, indices: torch.Tensor | None, new_values: torch.Tensor, old_values: torch.Tensor | None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        idx, new = _check_input(indices, new_values, old_values)
        n = idx.size
        first = int(idx[0]) if n else 0
        meta: dict[str, Any] = {"layout": "gaps", "first": first,
                                "values": "raw" if old_values is None else "diff"}
        if n == 0:
            meta.update(high_bits=8 if old_values is None else 2, high_escapes=0, value_escapes=0,
                        compression="none")
            return {"data": torch.empty(0, dtype=torch.uint8)}, meta
        new16 = new.view(torch.int16).numpy()
        if old_values is None:
            candidates = [(meta, _gaps_body(idx, new16, False, meta))]
        else:
            old16 = old_values.cpu().contiguous().view(torch.int16).numpy()
            diff = new16 - old16  # wrapping int16 arithmetic
            candidates = [(meta, _gaps_body(idx, diff, True, meta))]
            span = int(idx[-1]) - first + 1
            if span <= MAX_SPAN_PER_ELEMENT * (n + 1) and bool(np.all(diff != 0)):
                dense = np.zeros(span, "<i2")
                dense[idx - first] = diff
                candidates.append(({"layout": "span", "first": first, "span": span, "values": "diff"},
                                   [dense.tobytes()]))
        best: tuple[int, dict[str, Any], bytes] | None = None
        for m, sections in candidates:
            body = b"".join(sections)
            options = [("none", body)]
            if len(body) >= 64:
                options.append(("zstd", _compress(sections, self.level)))
            for how, data in options:
                if best is None or len(data) < best[0]:
                    best = (len(data), {**m, "compression": how}, data)
        assert best is not None
        _, meta, data = best
        return {"data": torch.frombuffer(bytearray(data), dtype=torch.uint8)}, meta

    def prepare(self, *, jit: bool = True) -> None:
        """Compile the numba decoder (~1 s, ~0.3 s from numba's disk cache); ``jit=False``:
        decode (and encode) with numpy from now on, without importing numba."""
        if jit:
            _kernel()
        else:
            with LOCK:
                _KERNEL[:] = [None]
                _ENC_KERNEL[:] = [None]

    def decode(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], count: int
    ) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
        try:
            return _decode(tensors, meta, count)
        except (KeyError, TypeError, ValueError, OverflowError, IndexError) as exc:
            raise FormatError(f"sparse-v3 chunk meta is incomplete or malformed "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from None


def _check_input(
    indices: torch.Tensor | None, new_values: torch.Tensor, old_values: torch.Tensor | None
) -> tuple[np.ndarray, torch.Tensor]:
    if indices is None:
        raise FormatError("sparse-v3 needs indices (it is a delta codec; anchors use 'dense')")
    if indices.dim() != 1 or new_values.dim() != 1 or indices.numel() != new_values.numel():
        raise FormatError(f"sparse-v3: indices {tuple(indices.shape)} and values "
                          f"{tuple(new_values.shape)} must be 1-D of equal length")
    if indices.numel() >= 2**31:
        raise FormatError("sparse-v3: a chunk holds at most 2**31 - 1 elements; use smaller files")
    if new_values.dtype != torch.bfloat16 or (
        old_values is not None and (old_values.dtype != torch.bfloat16 or old_values.shape != new_values.shape)
    ):
        raise FormatError("sparse-v3: new and base values must be bf16 1-D tensors of equal length")
    idx = indices.to(device="cpu", dtype=torch.int64).contiguous().numpy()
    if idx.size and (int(idx[0]) < 0 or int(idx[-1]) > MAX_INDEX):
        raise FormatError(f"sparse-v3: indices must lie in [0, {MAX_INDEX}]")
    if idx.size > 1 and not bool(np.all(idx[1:] > idx[:-1])):
        raise FormatError("sparse-v3: indices must be strictly increasing")
    return idx, new_values.cpu().contiguous()


# --------------------------------------------------------------------------------------------
# decode


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


def _decode(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], count: int
            ) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
    _checked_meta(meta, count)
    body = _body(tensors, meta, _body_size(meta, count))
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
    kernel = _kernel()
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


_KERNEL: list[Any] = []
"""``_fused`` compiled by numba: empty until decided, then [it or None]."""
_ENC_KERNEL: list[Any] = []
"""(``_enc_scan``, ``_enc_fields``, ``_field_tables``) compiled by numba: empty until decided,
then [them or None]."""


def _kernel() -> Any:
    """``_fused`` compiled by numba (installed with vLLM), or None where numba is missing or
    cannot compile: the numpy passes then decode the same chunks, ~1.5x slower.

    Compiled once per process, at ``prepare`` or else the first decode (~1 s, ~0.3 s from
    numba's disk cache where it finds a writable cache directory)."""
    return once(_KERNEL, lambda: first(compile_kernels(
        (_fused,), _check_decoder, log=logger, label="sparse-v3", what="the decoder",
        fallback="decoding with numpy (~1.5x slower)")))


def _encode_kernels() -> Any:
    """(``_enc_scan``, ``_enc_fields``, ``_field_tables``) compiled by numba, or None where
    numba is missing or cannot compile: the numpy passes of ``_gaps_numpy`` then write the
    same bytes, ~8x slower. Compiled once per process, at the first encode (~1 s, less from
    numba's disk cache)."""
    return once(_ENC_KERNEL, lambda: compile_kernels(
        (_enc_scan, _enc_fields, _field_tables), _check_encoder, log=logger, label="sparse-v3",
        what="the encoder", fallback="encoding with numpy (same bytes, slower)"))


def _check_decoder(fused: Any) -> None:
    idx, val = np.empty(2, np.int64), np.empty(2, np.int16)
    seen = fused(_readonly(np.zeros(2, np.uint8)), _readonly(np.array([0, 0xFC], np.uint8)),
                 _readonly(np.zeros(0, "<u4")), _readonly(np.array([7], "<i2")), 2, 5, idx, val, True)
    if tuple(seen) != (0, 1) or idx.tolist() != [5, 5] or val.tolist() != [-1, 7]:
        raise RuntimeError(f"self-check decoded {seen} {idx.tolist()} {val.tolist()}")


def _check_encoder(scan: Any, build: Any, tables: Any) -> None:
    idx, diff = np.array([3, 5, 1000], np.int64), np.array([-1, 300, 2], np.int16)
    joint = np.zeros(65536, np.int64)
    used = scan(idx, diff, joint)
    low, fields = np.empty(3, np.uint8), np.empty(3, np.uint8)
    high_over, value_over = np.empty(3, "<u4"), np.empty(3, "<i2")
    counts = build(idx, diff, 2, low, fields, high_over, value_over)
    got = (counts, high_over[:1], low, fields, value_over[:1], joint.sum(), used)
    if [np.asarray(a).tolist() for a in got] != [[1, 1], [0], [0, 2, 227], [0, 252, 15], [300], 3,
                                                 [3, 255]]:
        raise RuntimeError(f"self-check encoded {counts} {low.tolist()} {fields.tolist()}")
    joint = np.zeros(65536, np.int64)
    joint[3 * 256 + 300 % 256] = 2
    joint[255 * 256 + 1] = 1
    got_t, got_e = np.zeros((8, 256), np.int64), np.zeros((8, 2), np.int64)
    tables(joint, 256, 256, got_t, got_e)
    want_t, want_e = np.zeros((8, 256), np.int64), np.zeros((8, 2), np.int64)
    _field_tables_numpy(joint.reshape(256, 256), want_t, want_e)
    if not (np.array_equal(got_t, want_t) and np.array_equal(got_e, want_e)):
        raise RuntimeError("self-check: the width tables differ from numpy's")


__all__ = ["ZSTD_LEVEL", "SparseV3Codec"]

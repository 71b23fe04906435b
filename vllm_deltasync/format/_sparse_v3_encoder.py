"""sparse-v3, writing: the field-width choice, the two encoders, the zstd frame.

The layout is specified in :mod:`vllm_deltasync.format.sparse_v3` (and docs/codec.md).
``encode`` runs the numba kernels (``_enc_scan``, ``_enc_fields``, ``_field_tables``) where the
codec hands them in, else numpy passes (``_gaps_numpy``): the same bytes and meta either way.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from vllm_deltasync.errors import FormatError
from vllm_deltasync.format._sparse_v3_decoder import (
    MAX_INDEX,
    MAX_SPAN_PER_ELEMENT,
    ZSTD_CONTEXTS,
    zstd_module,
)

_SMALL = 256
"""Chunks of fewer elements choose field widths by raw size (zstd would not pay off)."""


def encode(indices: torch.Tensor | None, new_values: torch.Tensor, old_values: torch.Tensor | None,
       level: int, kernels: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One chunk's role ``data`` and meta, the smallest of the candidate layouts and
    compressions. ``kernels``: (``_enc_scan``, ``_enc_fields``, ``_field_tables``) compiled by
    numba, or None for the numpy passes (the same bytes)."""
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
        candidates = [(meta, _gaps_body(idx, new16, False, meta, kernels))]
    else:
        old16 = old_values.cpu().contiguous().view(torch.int16).numpy()
        diff = new16 - old16  # wrapping int16 arithmetic
        candidates = [(meta, _gaps_body(idx, diff, True, meta, kernels))]
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
            options.append(("zstd", _compress(sections, level)))
        for how, data in options:
            if best is None or len(data) < best[0]:
                best = (len(data), {**m, "compression": how}, data)
    assert best is not None
    _, meta, data = best
    return {"data": torch.frombuffer(bytearray(data), dtype=torch.uint8)}, meta


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


def _zigzag_code(d: np.ndarray) -> np.ndarray:
    """int16 d -> uint16 c = (zigzag(d) - 1) mod 2**16: -1, 1, -2, 2, ... -> 0, 1, 2, 3; 0 -> 65535."""
    zz = ((d << 1) ^ (d >> 15)).view(np.uint16)
    return zz - np.uint16(1)


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
    it per element). The eight costs are then summed in Python floats: the same IEEE operations
    in the same order as numpy's (the same choice), without numpy's per-call cost on 8 values.
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
    he, ve = escapes.T.tolist()  # the escape counts of each row, as Python ints (exact)
    if n < _SMALL:
        costs: list[float] = [n + 4 * h + 2 * v for h, v in zip(he, ve, strict=True)]
        costs[0] = 3.0 * n + 4 * he[0]
    else:
        # p = counts / n (every row sums to n > 0); p log2 p, 0 where p = 0 (log2(1) = 0: the
        # product is 0.0 there, no warning raised)
        p = tables / float(n)
        terms = p * np.log2(np.where(tables > 0, p, 1.0))
        bits = (np.maximum(-terms.sum(axis=1), 1.0) + 0.02).tolist()
        # per row, in Python floats: the same IEEE operations as numpy's, in the same order
        costs = [n * b / 8 + 3 * float(h) + 1.5 * float(v) for b, h, v in zip(bits, he, ve, strict=True)]
        costs[0] = n * bits[0] / 8 + 1.9 * n + 4 * float(he[0])
    order = (8, 1, 2, 3, 4, 5, 6, 7)  # row 0 is hb = 8; ties go to the smaller hb
    return order[min(range(8), key=lambda r: (costs[r], order[r]))]


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


def _compress(sections: list[bytes], level: int) -> bytes:
    """One zstd frame of the sections, each section starting a new block (so each gets its own
    Huffman table: a low-byte plane and a skewed field plane in one block would share one).

    zstd's fast parser with a 64-entry hash table and 7-byte matches: the sections hold almost no
    repeats, so the frame is essentially Huffman-coded literals, and matches found by a larger
    table or a deeper search cost more than the literals they replace. ~4 ns per changed element
    (btopt, used up to 0.4.0: ~75 ns) at ~0.2% fewer bytes. ``level`` fills the parameters not
    set here (none that change the output today)."""
    zstd = zstd_module()
    key = f"c{level}"
    cctx = getattr(ZSTD_CONTEXTS, key, None)
    if cctx is None:
        params = zstd.ZstdCompressionParameters.from_level(
            level, window_log=17, chain_log=12, hash_log=6, search_log=1, min_match=7,
            target_length=0, strategy=zstd.STRATEGY_FAST, write_content_size=1, write_checksum=0)
        cctx = zstd.ZstdCompressor(compression_params=params)
        setattr(ZSTD_CONTEXTS, key, cctx)
    obj = cctx.compressobj(size=sum(len(s) for s in sections))
    out = []
    for section in sections:
        if section:
            out.append(obj.compress(section))
            out.append(obj.flush(zstd.COMPRESSOBJ_FLUSH_BLOCK))
    out.append(obj.flush(zstd.COMPRESSOBJ_FLUSH_FINISH))
    return b"".join(out)


_JOINT = threading.local()


def _take_joint() -> np.ndarray:
    """A zeroed joint histogram (65536 int64, 512 KiB): this thread's, taken until
    ``_gaps_body`` zeroes the corner its scan wrote and gives it back (a chunk that fails in
    between leaves none behind). A fresh one per chunk cost more than encoding a small chunk:
    its pages were faulted in again every time."""
    joint = getattr(_JOINT, "joint", None)
    _JOINT.joint = None
    return np.zeros(65536, np.int64) if joint is None else joint


def _gaps_body(idx: np.ndarray, values16: np.ndarray, coded: bool, meta: dict[str, Any],
               kernels: Any) -> list[bytes]:
    """Sections of the ``gaps`` layout (``values16``: differences if ``coded``, else raw bits);
    fills ``meta``. The numba kernels (``_enc_scan``, ``_enc_fields``) where present, else numpy
    passes (``_gaps_numpy``): the same bytes."""
    n = idx.size
    if kernels is None:
        hb, high_over, low, fields, value_over = _gaps_numpy(idx, values16, coded)
    else:
        scan, build, tables = kernels
        if coded:
            joint = _take_joint()
            used = scan(idx, values16, joint)
            rows, cols = int(used[0]) + 1, int(used[1]) + 1
            hb = _choose_high_bits(joint.reshape(256, 256), n, (rows, cols), tables)
            joint.reshape(256, 256)[:rows, :cols] = 0  # all the scan wrote: zero for the next chunk
            _JOINT.joint = joint
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


__all__ = ["encode"]

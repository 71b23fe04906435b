"""``sparse-v2``: compact deltas, ~1.6 bytes per changed element instead of 6 (docs/codec.md).

One chunk of ``n`` changed elements; ``meta["first"]`` is its first flat index, ``gap[0] = 0``
and ``gap[i] = indices[i] - indices[i-1]``. Fixed-width fields with in-order escapes:

==================  ==========================  ===============================================
role                dtype, length               content
==================  ==========================  ===============================================
``gaps``            uint8 or int16 (uint16      ``min(gap, E)``, ``E = 2**meta["gap_bits"] - 1``
                    bits), n                    (gap_bits 8 or 16); ``E`` means escaped
``gap_overflow``    int16/32/64, gap_escapes    ``gap - E`` of each escaped gap, in order
``values``          see below                   the values' fields
``value_overflow``  int16, value_escapes        ``d`` of each escaped value, in order
==================  ==========================  ===============================================

``meta["values"]``:

* ``"diff4"`` / ``"diff8"``: ``d = (new_bits - old_bits) mod 2**16`` as int16, zigzag-coded
  (``0, -1, 1, -2`` -> ``0, 1, 2, 3``) into 4-bit fields (uint8, two per byte, element ``2j``
  in the low nibble) or 8-bit fields (uint8); the all-ones field is the escape. Lossless
  (relative: needs the exact base).
* ``"diff16"``: ``values`` is the int16 ``d`` itself.
* ``"raw"`` (no base values given): ``values`` is the bf16 new values (absolute).

Overflow roles exist only when their count (``meta["gap_escapes"]``,
``meta["value_escapes"]``) is non-zero. Widths are chosen per chunk by exact size.

``meta["compression"]``: ``"none"`` (``sparse-v2``: plain tensors, decoded with numpy on the
CPU or a few torch ops on any other device) or ``"zstd"`` (``sparse-v2-zstd``: role ``data`` is
one zstd frame of the roles' bytes, widest dtype first, listed in ``meta["roles"]`` as
``[name, dtype, length]``; ``meta["raw_bytes"]`` is its size; needs the ``codec`` extra).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vllm_deltasync.errors import ConfigError, FormatError
from vllm_deltasync.format.codec import Codec

ZSTD_LEVEL = 3
_FIELD_DTYPES = {8: torch.uint8, 16: torch.int16}
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.uint8, torch.int16, torch.int32, torch.int64, torch.bfloat16)}


def _zigzag(diff: np.ndarray) -> np.ndarray:
    """int16 -> uint16 codes: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ... (wrapping int16 arithmetic)."""
    return ((diff << 1) ^ (diff >> 15)).view(np.uint16)


_LUT8 = ((lambda z: (z >> 1) ^ -(z & 1))(torch.arange(256, dtype=torch.int32))).to(torch.int16)
"""uint8 zigzag code -> int16 difference."""
_LUT4x2 = torch.stack([_LUT8[torch.arange(256) & 15], _LUT8[torch.arange(256) >> 4]], dim=1)
"""byte of two 4-bit codes (low nibble first) -> their two int16 differences."""


def _overflow_dtype(values: np.ndarray) -> type:
    top = int(values.max()) if values.size else 0
    return np.int16 if top < 2**15 else np.int32 if top < 2**31 else np.int64


def _gap_width(gaps: np.ndarray, escaped8: int) -> int:
    """8 or 16 bits, whichever gives fewer bytes (the escape list counted at 2 bytes)."""
    if 2 * escaped8 <= gaps.size:  # 8-bit fields cost at most 2n: never more than 16-bit ones
        return 8
    escaped16 = int(np.count_nonzero(gaps >= 0xFFFF))
    return 8 if gaps.size + 2 * escaped8 <= 2 * gaps.size + 2 * escaped16 else 16


def _value_width(codes: np.ndarray, escaped4: int) -> int:
    n = codes.size
    if 4 * escaped4 <= n:  # 4-bit fields then cost at most n bytes: never more than 8 or 16 bits
        return 4
    sizes = {4: (n + 1) // 2 + 2 * escaped4, 8: n + 2 * int(np.count_nonzero(codes >= 255)), 16: 2 * n}
    return min(sizes, key=lambda w: (sizes[w], w))


def _encode_gaps(idx: np.ndarray, roles: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    gaps = np.empty_like(idx)
    gaps[:1] = 0
    np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    big = gaps >= 0xFF
    bits = _gap_width(gaps, int(np.count_nonzero(big)))
    if bits == 16:
        big = gaps >= 0xFFFF
    escape = (1 << bits) - 1
    fields = gaps.astype(np.uint8 if bits == 8 else np.uint16)
    over = gaps[big] - escape
    fields[big] = escape
    roles["gaps"] = torch.from_numpy(fields if bits == 8 else fields.view(np.int16))
    meta["gap_bits"], meta["gap_escapes"] = bits, over.size
    if over.size:
        roles["gap_overflow"] = torch.from_numpy(over.astype(_overflow_dtype(over)))


def _encode_values(new: torch.Tensor, old: torch.Tensor | None, roles: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    if old is None:
        roles["values"], meta["values"], meta["value_escapes"] = new, "raw", 0
        return
    diff = new.view(torch.int16).numpy() - old.cpu().contiguous().view(torch.int16).numpy()
    codes = _zigzag(diff)
    big = codes >= 15
    width = _value_width(codes, int(np.count_nonzero(big)))
    meta["values"] = f"diff{width}"
    if width == 16:
        roles["values"], meta["value_escapes"] = torch.from_numpy(diff), 0
        return
    if width == 8:
        big = codes >= 255
    fields: np.ndarray = codes.astype(np.uint8)
    fields[big] = (1 << width) - 1
    if width == 4:
        if fields.size % 2:
            fields = np.append(fields, np.uint8(0))
        fields = fields[0::2] | (fields[1::2] << 4)
    over = diff[big]
    roles["values"], meta["value_escapes"] = torch.from_numpy(fields), over.size
    if over.size:
        roles["value_overflow"] = torch.from_numpy(over)


_TABLES_ON_DEVICE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _table(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    key = (id(table), device)
    if key not in _TABLES_ON_DEVICE:
        _TABLES_ON_DEVICE[key] = table.to(device)
    return _TABLES_ON_DEVICE[key]


_MAX_INDEX = (1 << 53) - 1
_RAW_BYTES_PER_ELEMENT = 14
"""Most bytes one element may take before compression: a 16-bit gap field, an 8-byte gap
escape, a 16-bit value field and a 2-byte value escape (``raw_bytes`` is refused above this)."""


def _meta_int(meta: Mapping[str, Any], key: str, low: int, high: int) -> int:
    """An integer field of the chunk meta, checked to lie in ``[low, high]`` before use."""
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise FormatError(f"sparse-v2 chunk meta: {key}={str(value)[:40]} is not an integer in "
                          f"[{low}, {high}]")
    return value


def _decode_gaps(roles: Mapping[str, torch.Tensor], meta: Mapping[str, Any], count: int, use_numpy: bool) -> torch.Tensor:
    bits = _meta_int(meta, "gap_bits", 8, 16)
    m = _meta_int(meta, "gap_escapes", 0, count)
    first = _meta_int(meta, "first", 0, _MAX_INDEX)
    if bits not in _FIELD_DTYPES:
        raise FormatError(f"sparse-v2 chunk meta: gap_bits={bits} is not 8 or 16")
    fields = _role(roles, "gaps", _FIELD_DTYPES[bits], count)
    over = _overflow(roles, "gap_overflow", m, (torch.int16, torch.int32, torch.int64)) if m else None
    if use_numpy and fields.device.type == "cpu":  # numpy: less overhead, faster kernels here
        return torch.from_numpy(_gaps_numpy(fields.numpy(), bits, over, first))
    gaps = fields.to(torch.int64)
    if bits == 16:
        gaps &= 0xFFFF
    if over is not None:
        where = torch.nonzero(fields == (255 if bits == 8 else -1)).squeeze(1)
        _check_escapes(where.numel(), m, "gaps")
        gaps.index_add_(0, where, over.to(device=gaps.device, dtype=torch.int64))
    gaps[0] = first  # gap[0] is 0 by construction
    return torch.cumsum(gaps, 0, out=gaps)


def _gaps_numpy(fields: np.ndarray, bits: int, over: torch.Tensor | None, first: int) -> np.ndarray:
    wide = fields.view(np.uint16) if bits == 16 else fields
    gaps = wide.astype(np.int64)
    if over is not None:
        where = np.flatnonzero(wide == (1 << bits) - 1)
        _check_escapes(where.size, over.numel(), "gaps")
        gaps[where] += over.numpy()  # positions are distinct
    gaps[0] = first  # gap[0] is 0 by construction
    return np.cumsum(gaps, out=gaps)


def _check_escapes(found: int, expected: int, what: str) -> None:
    if found != expected:
        raise FormatError(f"sparse-v2: {found} escaped {what}, meta says {expected}")


def _decode_values(
    roles: Mapping[str, torch.Tensor], meta: Mapping[str, Any], count: int, use_numpy: bool
) -> tuple[torch.Tensor, bool]:
    mode, k = meta["values"], _meta_int(meta, "value_escapes", 0, count)
    if mode == "raw":
        return _role(roles, "values", torch.bfloat16, count), False
    if mode == "diff16":
        return _role(roles, "values", torch.int16, count), True
    if mode not in ("diff4", "diff8"):
        raise FormatError(f"sparse-v2 chunk meta: values={mode!r} is unknown")
    fields = _role(roles, "values", torch.uint8, count if mode == "diff8" else (count + 1) // 2)
    table, escaped = (_LUT8, int(_LUT8[255])) if mode == "diff8" else (_LUT4x2, int(_LUT8[15]))
    over = _overflow(roles, "value_overflow", k, (torch.int16,)) if k else None
    if use_numpy and fields.device.type == "cpu":
        values = np.take(table.numpy(), fields.numpy(), axis=0).reshape(-1)[:count]
        if over is not None:  # an escape decodes to the one difference it stands for
            where = np.flatnonzero(values == escaped)
            _check_escapes(where.size, k, "values")
            values[where] = over.numpy()
        return torch.from_numpy(values), True
    out = _table(table, fields.device).index_select(0, fields.to(torch.int64)).view(-1)[:count]
    if over is not None:
        where_t = torch.nonzero(out == escaped).squeeze(1)
        _check_escapes(where_t.numel(), k, "values")
        out.index_copy_(0, where_t, over.to(out.device))
    return out, True


def _overflow(roles: Mapping[str, torch.Tensor], role: str, m: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    t = roles.get(role)
    if t is None or t.dtype not in dtypes or t.dim() != 1 or t.numel() != m:
        raise FormatError(f"role {role!r} is missing or not {m} elements of {dtypes}")
    return t


def _role(roles: Mapping[str, torch.Tensor], role: str, dtype: torch.dtype, count: int) -> torch.Tensor:
    t = roles.get(role)
    if t is None:
        raise FormatError(f"role {role!r} is missing")
    if t.dtype != dtype or t.dim() != 1 or t.numel() != count:
        raise FormatError(f"role {role!r} is {t.dtype} {tuple(t.shape)}, expected {dtype} ({count},)")
    return t


class SparseV2Codec(Codec):
    """Gaps and bit-pattern differences as patched fixed-width fields; zstd optional."""

    relative = True
    max_bytes_per_element = 6
    """Sizes chunks like sparse-v1; encoded chunks are 4-6x smaller than this bound."""

    def __init__(self, *, compression: str = "none", level: int = ZSTD_LEVEL, cpu_kernels: str = "numpy") -> None:
        """``compression``: ``"none"`` (``sparse-v2``) or ``"zstd"`` (``sparse-v2-zstd``).

        ``cpu_kernels``: decode CPU tensors with ``"numpy"`` (faster here) or with the
        ``"torch"`` ops that every other device uses.
        """
        if compression not in ("zstd", "none"):
            raise ConfigError(f"sparse-v2: compression {compression!r} is not 'zstd' or 'none'")
        if cpu_kernels not in ("numpy", "torch"):
            raise ConfigError(f"sparse-v2: cpu_kernels {cpu_kernels!r} is not 'numpy' or 'torch'")
        self.name = "sparse-v2" if compression == "none" else "sparse-v2-zstd"
        self.compression, self.level, self.cpu_kernels = compression, level, cpu_kernels

    def encode(
        self, indices: torch.Tensor | None, new_values: torch.Tensor, old_values: torch.Tensor | None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        idx, new = _check_input(indices, new_values, old_values)
        roles: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {"first": int(idx[0]) if idx.numel() else 0}
        _encode_gaps(idx.numpy(), roles, meta)
        _encode_values(new, old_values, roles, meta)
        meta["compression"] = "none"
        if self.compression == "zstd" and idx.numel():
            roles, meta = _zstd_pack(roles, meta, self.level)
        return roles, meta

    def decode(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], count: int
    ) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
        try:
            if meta.get("compression") == "zstd":
                tensors = _zstd_unpack(tensors, meta, count)
            elif meta.get("compression") != "none":
                raise FormatError(f"sparse-v2 chunk meta: compression {meta.get('compression')!r} is unknown")
            if count == 0:
                dtype = torch.bfloat16 if meta["values"] == "raw" else torch.int16
                return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=dtype), meta["values"] != "raw"
            indices = _decode_gaps(tensors, meta, count, self.cpu_kernels == "numpy")
            values, relative = _decode_values(tensors, meta, count, self.cpu_kernels == "numpy")
        except (KeyError, TypeError, ValueError, OverflowError, IndexError) as exc:
            raise FormatError(f"sparse-v2 chunk meta is incomplete or malformed "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from None
        return indices, values, relative


def _check_input(
    indices: torch.Tensor | None, new_values: torch.Tensor, old_values: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if indices is None:
        raise FormatError("sparse-v2 needs indices (it is a delta codec; anchors use 'dense')")
    if indices.dim() != 1 or new_values.dim() != 1 or indices.numel() != new_values.numel():
        raise FormatError(
            f"sparse-v2: indices {tuple(indices.shape)} and values {tuple(new_values.shape)} "
            "must be 1-D of equal length"
        )
    if indices.numel() >= 2**31:
        raise FormatError("sparse-v2: a chunk holds at most 2**31 - 1 elements; use smaller files")
    if new_values.dtype != torch.bfloat16 or (
        old_values is not None and (old_values.dtype != torch.bfloat16 or old_values.shape != new_values.shape)
    ):
        raise FormatError("sparse-v2: new and base values must be bf16 1-D tensors of equal length")
    idx = indices.to(device="cpu", dtype=torch.int64).contiguous()
    if idx.numel() and int(idx[0]) < 0:
        raise FormatError("sparse-v2: indices must be non-negative")
    if idx.numel() > 1 and not bool(np.all(idx.numpy()[1:] > idx.numpy()[:-1])):
        raise FormatError("sparse-v2: indices must be strictly increasing")
    return idx, new_values.cpu().contiguous()


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ConfigError("sparse-v2-zstd needs zstandard: `pip install vllm-deltasync[codec]`") from None
    return zstandard


def _zstd_pack(roles: dict[str, torch.Tensor], meta: dict[str, Any], level: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All roles' bytes, widest dtype first (so every role stays aligned), in one zstd frame."""
    order = sorted(roles, key=lambda r: -roles[r].element_size())
    raw = b"".join(roles[r].contiguous().view(torch.uint8).numpy().tobytes() for r in order)
    frame = _zstd().ZstdCompressor(level=level).compress(raw)
    layout = [[r, _dtype_name(roles[r].dtype), roles[r].numel()] for r in order]
    meta = {**meta, "compression": "zstd", "roles": layout, "raw_bytes": len(raw)}
    return {"data": torch.frombuffer(bytearray(frame), dtype=torch.uint8)}, meta


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _zstd_unpack(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], count: int) -> dict[str, torch.Tensor]:
    """The roles out of the chunk's zstd frame. Nothing is allocated beyond what ``count``
    elements may legitimately take: ``raw_bytes`` is checked against that bound, and the frame's
    own content size (which the decompressor would otherwise allocate, whatever the limit
    asked) against ``raw_bytes``, before anything is decompressed."""
    zstandard = _zstd()
    data = tensors.get("data")
    if data is None or data.dtype != torch.uint8 or data.dim() != 1:
        raise FormatError("sparse-v2-zstd: role 'data' (uint8, 1-D) is missing or malformed")
    size = _meta_int(meta, "raw_bytes", 0, _RAW_BYTES_PER_ELEMENT * count + 64)
    frame = data.cpu().numpy()
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise FormatError(f"sparse-v2-zstd: the zstd frame header is corrupt ({exc})") from exc
    if declared >= 0 and declared != size:  # -1: not in the header, bounded by max_output_size
        raise FormatError(f"sparse-v2-zstd: the zstd frame says {declared} bytes, the manifest "
                          f"{size}; refused before decompressing")
    try:
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise FormatError(f"sparse-v2-zstd: the zstd frame is corrupt ({exc})") from exc
    if len(raw) != size:
        raise FormatError(f"sparse-v2-zstd: {len(raw)} bytes after decompression, expected {size}")
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out, offset = {}, 0
    layout = meta["roles"]
    if not isinstance(layout, list) or len(layout) > 8:
        raise FormatError("sparse-v2-zstd: meta 'roles' must list at most 8 [name, dtype, length]")
    for name, dtype_name, numel in layout:
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise FormatError(f"sparse-v2-zstd: role {str(name)[:40]!r} has unknown dtype {str(dtype_name)[:40]!r}")
        if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel <= size:
            raise FormatError(f"sparse-v2-zstd: role {str(name)[:40]!r} length {str(numel)[:40]} is out of range")
        nbytes = numel * dtype.itemsize
        if offset + nbytes > size:
            raise FormatError(f"sparse-v2-zstd: role {name!r} runs past the frame's {size} bytes")
        out[str(name)] = buf[offset : offset + nbytes].view(dtype)
        offset += nbytes
    return out



__all__ = ["ZSTD_LEVEL", "SparseV2Codec"]

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

This module is the codec and its numba kernels (decided once per process, ``vllm_deltasync._jit``);
the encoder is ``_sparse_v3_encoder.py``, the decoder (and the meta's checks) ``_sparse_v3_decoder.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vllm_deltasync._jit import LOCK, compile_kernels, first, once
from vllm_deltasync.format import _sparse_v3_decoder as decoder
from vllm_deltasync.format import _sparse_v3_encoder as encoder
from vllm_deltasync.format._sparse_v3_decoder import (
    MAX_INDEX,
    MAX_SPAN_PER_ELEMENT,
    _fused,
    _readonly,
)
from vllm_deltasync.format._sparse_v3_encoder import (
    _enc_fields,
    _enc_scan,
    _field_tables,
    _field_tables_numpy,
)
from vllm_deltasync.format.codec import Codec

ZSTD_LEVEL = 15

logger = logging.getLogger(__name__)


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
        return encoder.encode(indices, new_values, old_values, self.level, _encode_kernels())

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
        return decoder.decode(tensors, meta, count, _kernel())


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


__all__ = ["MAX_INDEX", "MAX_SPAN_PER_ELEMENT", "ZSTD_LEVEL", "SparseV3Codec"]

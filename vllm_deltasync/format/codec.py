"""Tensor payload encodings, registered by the name a manifest records.

A codec turns one chunk of one tensor into a few flat 1-D tensors (one per *role*, stored
under safetensors keys the manifest lists) plus a small JSON ``meta``, and back:

* ``dense``: anchors. Role ``values``: bf16 values of the flat element range ``[start, stop)``.
* ``sparse-v1``: deltas, the TRL layout. Roles ``indices`` (int32 flat indices into the
  tensor, strictly increasing) and ``values`` (bf16 new absolute values).

``sparse-v2`` lives in :mod:`~vllm_deltasync.format.sparse_v2`; the closed table of codecs by
name is :mod:`~vllm_deltasync.format.codecs`. Decoding yields :class:`TensorPatch` objects that
``server/worker/apply.py`` writes into live parameters.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm_deltasync.errors import FormatError


@dataclass
class TensorPatch:
    """Changed elements of one checkpoint tensor (or one dense run of it)."""

    name: str
    """Checkpoint name."""
    shape: tuple[int, ...]
    """Full checkpoint shape."""
    indices: torch.Tensor | None
    """int64 flat checkpoint indices, strictly increasing; None = dense run from ``offset``."""
    values: torch.Tensor
    """bf16 absolute values, or int16 bit-pattern differences when ``relative``."""
    offset: int = 0
    """Dense run: ``values`` cover flat ``[offset, offset + len(values))``."""
    relative: bool = False
    """True: ``values`` are int16 ``(new_bits - old_bits) mod 2**16``; needs the exact base."""

    def apply_to(self, flat: torch.Tensor) -> None:
        """Write this patch into ``flat`` (a 1-D bf16 tensor of the full tensor) in place."""
        if self.indices is None:
            target = flat[self.offset : self.offset + self.values.numel()]
            if self.relative:
                bits = target.view(torch.int16)
                bits.copy_(bits + self.values.to(torch.int16))
            else:
                target.copy_(self.values)
        elif self.relative:
            bits = flat.view(torch.int16)
            bits[self.indices] = bits[self.indices] + self.values.to(torch.int16)
        else:
            flat[self.indices] = self.values


class Codec(abc.ABC):
    """One encoding of chunk payloads."""

    name: str = ""
    version: int = 1
    """Version of this encoding; a manifest names it (``codec_version``) and a reader refuses newer."""
    dense: bool = False
    """True: a chunk covers the flat element range ``[start, stop)``; no indices."""
    relative: bool = False
    """True: decoded values are int16 bit-pattern differences against the base step."""
    max_bytes_per_element: int = 8
    """Upper bound on encoded bytes per element; the publisher sizes chunks with it."""
    min_reader: str | None = None
    """The first vllm-deltasync release that reads this encoding, where it is newer than the
    format version's own (a manifest using it says so in ``requires``); None: every v2 reader."""

    @abc.abstractmethod
    def encode(
        self,
        indices: torch.Tensor | None,
        new_values: torch.Tensor,
        old_values: torch.Tensor | None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(role -> flat tensor, meta)`` for one chunk.

        ``indices``: int64 sorted flat indices (None for dense codecs); ``new_values``: bf16;
        ``old_values``: the base's bf16 values at the same indices, or None (anchors).
        """

    def prepare(self, *, jit: bool = True) -> None:  # noqa: B027 - optional: most need nothing
        """Get ready to decode (compile what ``decode`` runs), so that the first step a server
        applies does not pay for it; ``jit=False``: decode without JIT-compiled code. Never
        raises; the default does nothing."""

    @abc.abstractmethod
    def decode(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], count: int
    ) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
        """``(indices int64 | None, values, relative)`` of one chunk of ``count`` elements."""

    def key(self, name: str, role: str, start: int) -> str:
        """Safetensors key of ``role`` for the chunk of tensor ``name`` starting at ``start``."""
        base = f"{name}.{role}"
        return base if start == 0 else f"{base}@{start}"


def _flat(tensors: Mapping[str, torch.Tensor], role: str, dtype: torch.dtype, count: int) -> torch.Tensor:
    try:
        t = tensors[role]
    except KeyError:
        raise FormatError(f"role {role!r} is missing") from None
    if t.dtype != dtype or t.dim() != 1 or t.numel() != count:
        raise FormatError(
            f"role {role!r} is {t.dtype} {tuple(t.shape)}, expected {dtype} ({count},)"
        )
    return t


class DenseCodec(Codec):
    """Anchors: bf16 values of a flat element range."""

    name = "dense"
    dense = True
    max_bytes_per_element = 2

    def encode(
        self,
        indices: torch.Tensor | None,
        new_values: torch.Tensor,
        old_values: torch.Tensor | None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {"values": new_values.contiguous()}, {}

    def decode(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], count: int
    ) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
        return None, _flat(tensors, "values", torch.bfloat16, count), False

    def key(self, name: str, role: str, start: int) -> str:
        return name if start == 0 else f"{name}@{start}"


class SparseV1Codec(Codec):
    """Deltas, TRL layout: int32 flat indices plus bf16 absolute values."""

    name = "sparse-v1"
    max_bytes_per_element = 6

    def encode(
        self,
        indices: torch.Tensor | None,
        new_values: torch.Tensor,
        old_values: torch.Tensor | None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if indices is None:
            raise FormatError("sparse-v1 needs indices")
        if indices.numel() and int(indices[-1]) >= 2**31:
            raise FormatError(
                "sparse-v1 stores int32 indices; a tensor with 2**31 or more elements needs "
                "another codec"
            )
        return {"indices": indices.to(torch.int32), "values": new_values.contiguous()}, {}

    def decode(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], count: int
    ) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
        indices = _flat(tensors, "indices", torch.int32, count).to(torch.int64)
        return indices, _flat(tensors, "values", torch.bfloat16, count), False


def check_indices(indices: torch.Tensor, numel: int, name: str, source: str) -> None:
    if indices.numel() == 0:
        return
    if int(indices[0]) < 0 or int(indices[-1]) >= numel:
        raise FormatError(f"{source}: tensor {name!r}: an index is outside [0, {numel})")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise FormatError(f"{source}: tensor {name!r}: indices are not strictly increasing")


__all__ = ["Codec", "DenseCodec", "SparseV1Codec", "TensorPatch", "check_indices"]

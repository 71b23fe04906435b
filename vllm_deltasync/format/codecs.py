"""The codecs this version reads and writes: one closed table, by the name a manifest records.

A manifest's tensor entry names its encoding; a name missing here is refused with a message
that says to upgrade (docs/format.md, compatibility).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.codec import Codec, DenseCodec, SparseV1Codec, TensorPatch, check_indices
from vllm_deltasync.format.manifest import Chunk, Region, TensorEntry
from vllm_deltasync.format.sparse_v2 import SparseV2Codec
from vllm_deltasync.format.sparse_v3 import SparseV3Codec

CODECS: Mapping[str, Codec] = {
    codec.name: codec
    for codec in (DenseCodec(), SparseV1Codec(), SparseV2Codec(), SparseV2Codec(compression="zstd"),
                  SparseV3Codec())
}


def get_codec(name: str) -> Codec:
    """The codec called ``name``; :class:`FormatError` if this version has none."""
    try:
        return CODECS[name]
    except KeyError:
        known = ", ".join(sorted(CODECS))
        raise FormatError(
            f"encoding {name!r} is unknown to this version (known: {known}); upgrade vllm-deltasync"
        ) from None


def codec_names() -> list[str]:
    return sorted(CODECS)


def prepare_decoders(*, jit: bool = True) -> None:
    """Ready every codec's decoder (a server calls this before it starts following); ``jit``
    False: decode without JIT-compiled code (``SyncConfig.decoder="numpy"``)."""
    for codec in CODECS.values():
        codec.prepare(jit=jit)


def decode_chunk(
    entry: TensorEntry, chunk: Chunk, file_tensors: Mapping[str, torch.Tensor], *, source: str
) -> TensorPatch:
    """Decode one chunk of ``entry`` from the tensors of its data file; checks bounds."""
    codec = get_codec(entry.encoding)
    try:
        roles = {role: file_tensors[key] for role, key in chunk.keys.items()}
    except KeyError as exc:
        raise FormatError(f"{source}: tensor {entry.name!r}: key {exc.args[0]!r} is missing") from None
    try:
        indices, values, relative = codec.decode(roles, chunk.meta, chunk.count)
    except FormatError as exc:
        raise FormatError(f"{source}: tensor {entry.name!r} ({entry.encoding}): {exc}") from exc
    numel = entry.numel
    region = chunk.region
    if region is not None:  # v2: local indices in the chunk's region, mapped to flat ones
        return _in_region(entry, chunk, region, indices, values, relative, source)
    if indices is None:
        if chunk.stop > numel:
            raise FormatError(f"{source}: tensor {entry.name!r}: range end {chunk.stop} > {numel}")
        return TensorPatch(entry.name, entry.shape, None, values, chunk.start, relative)
    check_indices(indices, numel, entry.name, source)
    return TensorPatch(entry.name, entry.shape, indices, values, 0, relative)


def _in_region(entry: TensorEntry, chunk: Chunk, region: Region, indices: torch.Tensor | None,
               values: torch.Tensor, relative: bool, source: str) -> TensorPatch:
    if indices is None:
        if region.rows == 1:
            return TensorPatch(entry.name, entry.shape, None, values, region.offset, relative)
        local = torch.arange(region.size, dtype=torch.int64)
    else:
        local = indices
        check_indices(local, region.size, entry.name, source)
    if region.rows == 1:
        flat = local + region.offset if region.offset else local
    else:
        flat = (local // region.row_len) * region.row_stride + local % region.row_len + region.offset
    return TensorPatch(entry.name, entry.shape, flat, values, 0, relative)


__all__ = ["CODECS", "codec_names", "decode_chunk", "get_codec", "prepare_decoders"]

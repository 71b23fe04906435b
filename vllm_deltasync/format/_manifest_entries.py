"""The records a manifest is made of (files, tensors, chunks, regions, totals) and the
format's constants; :mod:`vllm_deltasync.format.manifest` re-exports them with ``Manifest``.

Plain frozen dataclasses: the JSON document and its validation are
:mod:`vllm_deltasync.format._manifest_json`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["anchor", "delta"]

FORMAT_NAME = "vllm-deltasync"
SCHEMA_VERSION = 3
"""The newest format version: what the publisher writes and the highest one this reader reads."""
READS = (1, 2, 3)
"""Format versions this reader reads (version 1 is read indefinitely)."""
MIN_READER = {1: "0.1.0", 2: "0.2.0", 3: "0.4.0"}
"""Format version -> the first vllm-deltasync release that reads it (written as ``requires``)."""
ROLE_DTYPES = ("BF16", "I16", "I32", "I64", "U8")
"""Safetensors dtypes a v2 chunk role may have."""
MAX_REGION_ROWS = 1 << 23
"""Most region rows the chunks of one tensor may list together (the coverage check's memory)."""


@dataclass(frozen=True)
class FileEntry:
    """One data file of a step."""

    path: str
    """Path relative to the bucket prefix."""
    size: int
    """Size in bytes."""
    sha256: str
    """Lowercase hex sha256 of the whole file."""
    index: Mapping[str, tuple[tuple[int, int], ...]] | None = None
    """v2: tensor name -> its byte ranges ``(offset, length)`` in this file, ascending, merged."""


@dataclass(frozen=True)
class RoleRange:
    """v2: where one role of one chunk lies in its data file."""

    key: str
    """Safetensors key (for readers of whole files)."""
    dtype: str
    """Safetensors dtype: BF16, I16, I32, I64 or U8."""
    offset: int
    """First byte, counted from the start of the file."""
    length: int
    """Bytes."""


@dataclass(frozen=True)
class Region:
    """v2: the flat elements a chunk may touch, and how its local indices map to them.

    Local index ``j`` in ``[0, rows * row_len)`` is flat element
    ``offset + (j // row_len) * row_stride + j % row_len`` (rows of a column shard). A
    contiguous region has ``rows == 1``.
    """

    offset: int
    rows: int
    row_len: int
    row_stride: int

    @property
    def size(self) -> int:
        return self.rows * self.row_len

    def to_json(self) -> list[int]:
        if self.rows == 1:
            return [self.offset, self.row_len]
        return [self.offset, self.rows, self.row_len, self.row_stride]

    def intervals(self) -> list[tuple[int, int]]:
        """Flat ``[start, stop)`` runs covered, ascending."""
        return [(self.offset + r * self.row_stride, self.offset + r * self.row_stride + self.row_len)
                for r in range(self.rows)] if self.row_len else []


@dataclass(frozen=True)
class Chunk:
    """One piece of one tensor inside one data file."""

    file: int
    """Index into ``Manifest.files``."""
    keys: dict[str, str]
    """Role -> safetensors key, e.g. ``{"indices": "w.indices", "values": "w.values"}``."""
    start: int
    """Dense: first flat element. Sparse: first position in the tensor's changed-element list."""
    stop: int
    """End (exclusive) of the same range."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Codec parameters for this chunk (JSON values); empty for dense and sparse-v1."""
    region: Region | None = None
    """v2: the elements this chunk may touch (v1: None; ``start``/``stop`` place it)."""
    roles: Mapping[str, RoleRange] | None = None
    """v2: role -> byte range in the file."""
    sha256: str | None = None
    """v2: sha256 of the chunk's role bytes, roles in sorted name order, concatenated."""

    @property
    def count(self) -> int:
        """Elements this chunk carries."""
        return self.stop - self.start


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a step."""

    name: str
    """Checkpoint (Hugging Face) name."""
    shape: tuple[int, ...]
    """Full checkpoint shape."""
    dtype: str
    """Element type of the reconstructed tensor: ``"bfloat16"``."""
    encoding: str
    """Codec name: ``"dense"``, ``"sparse-v1"`` or a registered codec."""
    changed: int
    """Elements that differ from the previous published step (anchors: informative)."""
    chunks: tuple[Chunk, ...]
    """Where the payload lives (v1: in range order; v2: any order)."""
    codec_version: int = 1
    """Version of ``encoding`` (every codec of this release is at version 1)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Totals:
    """Sums over a step."""

    tensors: int
    """Parameters in the parameter set (not only those listed)."""
    elements: int
    """Elements in the parameter set."""
    changed: int
    """Changed elements (sum of ``TensorEntry.changed``)."""
    bytes: int
    """Bytes of all data files."""


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted ``(offset, length)`` ranges, adjacent or overlapping ones merged."""
    out: list[list[int]] = []
    for off, length in sorted(ranges):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + length - out[-1][0])
        else:
            out.append([off, length])
    return tuple((a, b) for a, b in out)


__all__ = ["FORMAT_NAME", "MAX_REGION_ROWS", "MIN_READER", "READS", "ROLE_DTYPES", "SCHEMA_VERSION",
           "Chunk", "FileEntry", "Kind", "Region", "RoleRange", "TensorEntry", "Totals", "merge_ranges"]

"""The coverage rule: an anchor covers every element of every fingerprinted parameter exactly
once; a delta touches each element at most once (docs/format.md, "Coverage").

:func:`check_manifest` checks what the manifest alone shows (before any download):

* anchors: the tensors are exactly the fingerprinted parameter set, every tensor is dense and
  its chunks cover ``[0, numel)`` exactly once;
* deltas: per tensor, the chunks' element counts add up to ``changed`` and (v2) the chunks'
  regions are pairwise disjoint; v1 chunks tile the tensor's changed-element list in order;
* every step: ``totals.changed`` is the sum of the tensors' ``changed``.

What only decoding shows is checked as chunks are decoded: a v2 chunk's local indices lie in
its region (:func:`vllm_deltasync.format.codecs.decode_chunk`), and v1 sparse chunks of one
tensor hold ascending, disjoint index ranges (:class:`SparseOrder`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.codecs import get_codec
from vllm_deltasync.format.manifest import MAX_REGION_ROWS, Manifest, TensorEntry, fingerprint


class TableRow(NamedTuple):
    """One tensor of a step as the step-wide rules see it (no chunks)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    encoding: str
    changed: int
    numel: int


def check_manifest(m: Manifest, table: Sequence[TableRow] | None = None) -> None:
    """:class:`FormatError` naming the step and tensor when ``m`` breaks the coverage rule.

    ``table``: every tensor of the step when ``m.tensors`` holds only some of them (a reader
    that selects tensors, format/_selected.py): the step-wide rules run on ``table``, the
    per-tensor ones on ``m.tensors``."""
    where = f"step {m.step} ({m.kind})"
    rows: Sequence[TableRow | TensorEntry] = m.tensors if table is None else table
    if m.totals.changed != sum(t.changed for t in rows):
        raise FormatError(f"{where}: totals.changed {m.totals.changed} is not the sum of its tensors' changed")
    if m.kind == "anchor":
        _check_anchor_set(m, rows, where)
    for t in m.tensors:
        if m.schema_version == 1:
            _check_v1(m, t, where)
        else:
            _check_v2(m, t, where)


def _check_anchor_set(m: Manifest, rows: Sequence[TableRow | TensorEntry], where: str) -> None:
    if len(rows) != m.totals.tensors or sum(t.numel for t in rows) != m.totals.elements:
        raise FormatError(f"{where}: lists {len(rows)} tensors of "
                          f"{sum(t.numel for t in rows)} elements, its totals say "
                          f"{m.totals.tensors} of {m.totals.elements}: a tensor is missing")
    if fingerprint((t.name, t.shape, t.dtype) for t in rows) != m.fingerprint:
        raise FormatError(f"{where}: its tensors are not the parameter set of its fingerprint "
                          "(a tensor is missing, extra or of another shape)")
    for t in rows:
        if not get_codec(t.encoding).dense:
            raise FormatError(f"{where}: tensor {t.name!r} is {t.encoding}; anchors are dense")


def _check_v1(m: Manifest, t: TensorEntry, where: str) -> None:
    """v1: chunks in list order tile ``[0, numel)`` (dense) or ``[0, changed)`` (sparse)."""
    dense = get_codec(t.encoding).dense
    end = t.numel if dense else t.changed
    position = 0
    for chunk in t.chunks:
        if chunk.start != position:
            raise FormatError(f"{where}: tensor {t.name!r}: chunks leave a gap or overlap at "
                              f"{'element' if dense else 'changed position'} {position}")
        position = chunk.stop
    if position != end and (m.kind == "anchor" or not dense):
        raise FormatError(f"{where}: tensor {t.name!r}: chunks cover {position} of its "
                          f"{end} {'elements' if dense else 'changed elements'}")


def _check_v2(m: Manifest, t: TensorEntry, where: str) -> None:
    """v2: regions pairwise disjoint; dense chunks fill theirs; an anchor's fill the tensor."""
    dense = get_codec(t.encoding).dense
    rows_listed = sum(c.region.rows for c in t.chunks if c.region is not None)
    if rows_listed > MAX_REGION_ROWS or rows_listed > max(t.numel, 1):
        raise FormatError(f"{where}: tensor {t.name!r}: its chunks list {rows_listed} region rows, "
                          f"more than its {t.numel} elements allow (or {MAX_REGION_ROWS})")
    covered = _covered(t, dense, where)
    if m.kind == "anchor" and covered != t.numel:
        raise FormatError(f"{where}: tensor {t.name!r}: chunks cover {covered} of its {t.numel} elements")
    count = sum(c.count for c in t.chunks)
    if m.kind == "delta" and count != t.changed:
        raise FormatError(f"{where}: tensor {t.name!r}: chunks carry {count} elements, "
                          f"its changed says {t.changed}")


def _covered(t: TensorEntry, dense: bool, where: str) -> int:
    """Elements the regions of ``t``'s chunks cover; FormatError when two overlap."""
    for chunk in t.chunks:
        assert chunk.region is not None  # the v2 parser requires one
        if dense and chunk.count != chunk.region.size:
            raise FormatError(f"{where}: tensor {t.name!r}: a dense chunk of {chunk.count} "
                              f"elements in a region of {chunk.region.size}")
    only = t.chunks[0].region if len(t.chunks) == 1 else None
    if only is not None:  # the rows of one region never overlap (row_len <= row_stride)
        return only.size
    starts, stops = [], []
    for chunk in t.chunks:
        region = chunk.region
        assert region is not None
        rows = np.arange(region.rows, dtype=np.int64) * region.row_stride + region.offset
        if region.row_len:
            starts.append(rows)
            stops.append(rows + region.row_len)
    if not starts:
        return 0
    lo, hi = np.concatenate(starts), np.concatenate(stops)
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    clash = np.flatnonzero(lo[1:] < hi[:-1])
    if clash.size:
        raise FormatError(f"{where}: tensor {t.name!r}: two chunks cover element "
                          f"{int(lo[clash[0] + 1])} (overlapping chunks, or one listed twice)")
    return int((hi - lo).sum())


class SparseOrder:
    """v1 deltas: sparse chunks of one tensor must hold ascending, disjoint index ranges."""

    def __init__(self, m: Manifest) -> None:
        self.m = m
        self.seen: dict[str, list[tuple[int, int, int]]] = {}

    def add(self, start: int, patch: TensorPatch) -> None:
        if self.m.schema_version != 1 or patch.indices is None or patch.indices.numel() == 0:
            return
        self.seen.setdefault(patch.name, []).append(
            (start, int(patch.indices[0]), int(patch.indices[-1])))

    def check(self) -> None:
        for name, spans in self.seen.items():
            spans.sort()
            for (_, _, last), (_, first, _) in zip(spans, spans[1:], strict=False):
                if first <= last:
                    raise FormatError(f"step {self.m.step}: tensor {name!r}: two chunks touch "
                                      f"element {first} (a delta touches each element at most once)")


__all__ = ["SparseOrder", "TableRow", "check_manifest"]

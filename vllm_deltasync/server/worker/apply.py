"""In-place writes of translated patches into live parameters, and digests of what they hold.

The pieces come from :meth:`vllm_deltasync.server.worker.shardmap.ShardMap.translate`. :func:`prepare` moves
them to each parameter's device (and into its dtype) ahead of time, so that
:func:`apply_patches`, run at the switch, only scatters: ``index_copy_`` into
``param.data.view(-1)`` for sparse pieces, a strided ``copy_`` for dense ones. Both write into
the existing storage (same tensor, same address), so CUDA graphs and compiled graphs that read
parameters by address keep working.

Relative pieces carry int16 differences of bf16 bit patterns: ``new_bits = old_bits + diff``
modulo 2**16, computed on int16 views of the parameter on its device.

Undo (:class:`Undo`): given one, :func:`apply_patches` records how to put back every piece it
wrote, so a switch that fails on some rank can be taken back on all of them, bit for bit.
A relative piece is its own undo (subtract the differences: no copy); an absolute sparse piece
keeps the old values at its indices (one gather, the size of the piece). Dense absolute pieces
(anchors) are not recorded, since that would copy the model: after one is written the undo is
incomplete and the rank can only resync through an anchor.

Digest definition (:func:`tensor_digest`, :func:`checkpoint_digest`): sha256 over the raw bytes
of the elements of one checkpoint tensor that this rank holds, in increasing checkpoint flat
index, each element once (little-endian, in the parameter's dtype). At TP=1 it equals the sha256
of the whole checkpoint tensor's bytes; under TP it is per rank, and the trainer side can compute
the same number from a full tensor with :func:`checkpoint_digest`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from vllm_deltasync.errors import ApplyError
from vllm_deltasync.server.worker.shardmap import Piece, ShardMap, Target


def prepare(pieces: Iterable[Piece], *, non_blocking: bool = False) -> list[Piece]:
    """Move indices and values to each parameter's device and dtype, ready to scatter.

    Dense values (strided views of a patch) are gathered into contiguous tensors of the piece's
    shape, so only this rank's share travels to the device.
    """
    out = []
    for piece in pieces:
        param, indices, values = piece
        device = param.device
        if indices is not None:
            indices = indices.to(device, non_blocking=non_blocking)
        values = values.contiguous().to(device, non_blocking=non_blocking)
        if not piece.relative and values.dtype != param.dtype:
            values = values.to(param.dtype)
        out.append(Piece(param, indices, values, dense=piece.dense, relative=piece.relative))
    return out


def merge_pieces(pieces: Iterable[Piece]) -> list[Piece]:
    """The pieces of one step with the sparse pieces of each parameter merged into one (per
    relative / absolute and values dtype): one scatter per parameter instead of one per
    checkpoint tensor (a MoE layer's experts are thousands of tensors in two parameters).
    Dense pieces are kept as they are, first.

    Only for the pieces of one step: there no two pieces write the same element (a patch has
    each index once, a step's chunks are disjoint, and the shard map refuses two checkpoint
    names writing one element), so the merged indices are distinct and order does not matter.
    """
    dense: list[Piece] = []
    groups: dict[tuple[int, bool, torch.dtype], list[Piece]] = {}
    for piece in pieces:
        if piece.indices is None:
            dense.append(piece)
        else:
            key = (id(piece.param), piece.relative, piece.values.dtype)
            groups.setdefault(key, []).append(piece)
    out = dense
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        first = group[0]
        indices = torch.cat([p.indices for p in group if p.indices is not None])
        values = torch.cat([p.values.reshape(-1) for p in group])
        out.append(Piece(first.param, indices, values, relative=first.relative))
    return out


@dataclass
class Undo:
    """How to put back what :func:`apply_patches` wrote (module docstring)."""

    entries: list[tuple[Piece, torch.Tensor | None]] = field(default_factory=list)
    """Written pieces in write order, each with the old values it replaced (None: relative)."""
    complete: bool = True
    """False once a piece was written that cannot be taken back (a dense absolute one)."""

    def record(self, piece: Piece, flat: torch.Tensor) -> torch.Tensor | None:
        """Before ``piece`` is written into ``flat``: what must be kept to take it back."""
        if piece.relative:
            return None
        if piece.dense is not None:
            self.complete = False
            return None
        assert piece.indices is not None
        return flat.index_select(0, piece.indices)

    def revert(self) -> None:
        """Put back every recorded piece, newest first. Raises if the undo is incomplete."""
        if not self.complete:
            raise ApplyError("a dense (anchor) piece was written; it cannot be taken back")
        while self.entries:
            piece, old = self.entries.pop()
            flat = _flat(piece)
            if piece.relative:
                back = Piece(piece.param, piece.indices, -piece.values, dense=piece.dense,
                             relative=True)
            else:
                assert old is not None
                back = Piece(piece.param, piece.indices, old, dense=piece.dense, relative=False)
            _write(flat, back)


def apply_patches(pieces: Iterable[Piece], undo: Undo | None = None) -> int:
    """Write every piece in place; return the number of elements written.

    With ``undo``, every piece written is recorded in it first (see :class:`Undo`). Pieces not
    yet prepared are moved on the fly (slower: do :func:`prepare` before the switch).
    """
    written = 0
    for piece in pieces:
        if piece.values.device != piece.param.device:
            (piece,) = prepare([piece])
        flat = _flat(piece)
        old = undo.record(piece, flat) if undo is not None else None
        _write(flat, piece)
        if undo is not None:
            undo.entries.append((piece, old))
        written += piece.values.numel()
    return written


def _flat(piece: Piece) -> torch.Tensor:
    """The parameter's storage as a flat view, int16 for relative pieces."""
    flat = piece.param.data.view(-1)
    if piece.relative:
        if piece.values.dtype != torch.int16 or flat.element_size() != 2:
            raise ApplyError(
                f"relative piece needs int16 differences and a 16-bit parameter, got "
                f"{piece.values.dtype} into {flat.dtype}"
            )
        flat = flat.view(torch.int16)
    return flat


def _write(flat: torch.Tensor, piece: Piece) -> None:
    values = piece.values
    if piece.dense is not None:
        d = piece.dense
        dst = flat.as_strided(d.sizes, d.strides, flat.storage_offset() + d.offset)
        values = values.reshape(d.sizes)
        if piece.relative:
            dst.add_(values)
        else:
            dst.copy_(values)
        return
    indices = piece.indices
    if indices is None:
        raise ApplyError("sparse piece without indices")
    if piece.relative:
        values = flat.index_select(0, indices).add_(values)
    flat.index_copy_(0, indices, values.to(flat.dtype))


def _ordered_targets(shardmap: ShardMap, name: str) -> list[Target]:
    name = shardmap.covered_by.get(name, name)
    if name in shardmap.ignored:
        raise ApplyError(f"checkpoint tensor {name!r} is not held by the engine ({shardmap.ignored[name]})")
    return sorted(shardmap.targets(name), key=lambda t: t.block.src_offset)


def _rank_values(targets: list[Target], block_values: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-block values in checkpoint order, each checkpoint element once."""
    disjoint = all(
        a.block.src_offset + a.block.src_extent < b.block.src_offset
        for a, b in zip(targets, targets[1:], strict=False)
    )
    if disjoint:
        return torch.cat([v.reshape(-1) for v in block_values]) if block_values else torch.empty(0)
    src = torch.cat([t.block.src_indices() for t in targets])
    vals = torch.cat([v.reshape(-1) for v in block_values])
    order = torch.argsort(src, stable=True)
    src, vals = src[order], vals[order]
    first = torch.ones_like(src, dtype=torch.bool)
    first[1:] = src[1:] != src[:-1]
    return vals[first]


def sha256_hex(values: torch.Tensor) -> str:
    """``sha256:<hex>`` of a tensor's raw bytes in flat order (what a TP=1 rank reports for a
    whole tensor)."""
    data = values.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tensor_digest(shardmap: ShardMap, name: str) -> str:
    """sha256 of the live elements of checkpoint tensor ``name`` on this rank (module doc)."""
    targets = _ordered_targets(shardmap, name)
    return sha256_hex(_rank_values(targets, live_values(targets)))


def live_values(targets: list[Target]) -> list[torch.Tensor]:
    """What each target's block holds in the live parameter (runtime layout followed), in the
    block's multi-index order."""
    values = []
    for t in targets:
        b = t.block
        flat = t.param.data.view(-1)
        if t.layout is not None:
            values.append(flat.index_select(0, t.dst_indices().to(flat.device)))
        else:
            values.append(flat.as_strided(b.sizes, b.dst_strides,
                                          flat.storage_offset() + b.dst_offset))
    return values


def checkpoint_digest(shardmap: ShardMap, name: str, full: torch.Tensor) -> str:
    """The :func:`tensor_digest` this rank should report when it holds checkpoint ``full``."""
    targets = _ordered_targets(shardmap, name)
    flat = full.detach().contiguous().reshape(-1)
    dtype = targets[0].param.dtype if targets else flat.dtype
    values = [
        flat.as_strided(t.block.sizes, t.block.src_strides, flat.storage_offset() + t.block.src_offset)
        for t in targets
    ]
    return sha256_hex(_rank_values(targets, values).to(dtype))


__all__ = ["Undo", "apply_patches", "checkpoint_digest", "live_values", "merge_pieces", "prepare",
           "sha256_hex", "tensor_digest"]

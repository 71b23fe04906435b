"""Checkpoint coordinates -> this rank's runtime parameters, derived from the model's own loaders.

How the map is derived
----------------------
A rollout engine holds *runtime* parameters (``qkv_proj``, ``gate_up_proj``, vocab-padded
embeddings, each narrowed to the local tensor-parallel rank); deltas arrive in *checkpoint*
(Hugging Face) coordinates. Instead of a table per model family, :meth:`ShardMap.from_model`
asks the model itself, once at start (the idea of vLLM PR #43375):

1. For every checkpoint name it calls the model's own ``load_weights([(name, probe)])`` with a
   *probe*: an empty tensor of the checkpoint shape and dtype on the ``meta`` device, so it costs
   no memory but keeps view geometry (storage offset, sizes, strides) through ``narrow``,
   ``view``, ``transpose``, ``select``, ``chunk`` and the like.
2. A ``TorchDispatchMode`` watches every aten op the loaders run. When a ``copy_`` writes a
   probe view into a parameter's storage, it records one *block*: the source view (offset,
   sizes, strides in the flat checkpoint tensor) and the destination view (offset, strides in
   the flat parameter). The copy itself is skipped, and so is every other write into a
   parameter (``fill_`` of vocab padding, ...): live weights are never touched.
3. Anything the map cannot represent raises :class:`~vllm_deltasync.errors.ApplyError` naming
   the checkpoint tensor: a value-transforming op on the probe (``mul``, ``cat``, a dtype
   conversion that is then viewed differently), a copy into a temporary, a loader exception, a
   loader that replaces ``param.data``. A name the loaders write nothing for is an error too,
   except three explicit cases: a name tied to a parameter that another checkpoint name places
   (``lm_head.weight`` with tied embeddings: recorded as *covered by* ``model.embed_tokens.weight``)
   and buffers the engine recomputes (``rotary_emb.inv_freq``), and names whose parameter's
   ``weight_loader`` declined them (answered False, vLLM's "not on this rank": an expert held by
   another expert-parallel rank), recorded as *not on this rank*. Two names whose blocks are
   identical (tied weights both loaded) keep only the first (the other is *covered by* it, so a
   relative patch is never applied twice); two names writing overlapping elements are an error.

The probe lives in ``_shardprobe.py`` and ``placement.py`` classifies what it could not place;
this module builds the map and translates.
Each block is normalised (size-1 dims dropped, dims sorted by source stride, contiguous dims
merged): a column-parallel shard becomes one 1-D range, a row-parallel shard two dims. The map
holds a few integers per (checkpoint tensor, rank), never per-element indices.

Translating a patch
-------------------
For sorted flat checkpoint indices, each block first cuts the index range it can hit with two
``searchsorted`` calls, then decomposes ``index - offset`` greedily by the (nested) source
strides into a multi-index, keeps the elements inside the block and maps them through the
destination strides. All of it is vectorised torch on the device the patch lives on (move the
patch to the parameter's device first to translate there). An element may land in several
blocks (a loader writing one tensor twice): every placement is returned; KV heads replicated
across ranks simply appear in each of those ranks' maps. Dense runs that cover the whole tensor
become strided views (no index tensors); partial runs become a slice when the block is one
range, else indices for the run only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from vllm_deltasync.errors import ApplyError
from vllm_deltasync.server.worker._shardprobe import Block, Loader, probe_model
from vllm_deltasync.server.worker.layouts import Layout, LayoutSpec
from vllm_deltasync.server.worker.placement import (
    classify_unplaced,
    duplicates,
    layout_of,
    standins,
)

if TYPE_CHECKING:
    from vllm_deltasync.format.codec import TensorPatch

@dataclass(frozen=True)
class DenseView:
    """Destination of a dense piece: a strided view of ``param.view(-1)``."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int


class Piece(tuple):  # type: ignore[type-arg]
    """``(param, local_flat_indices, values)`` for one block of one patch on this rank.

    ``local_flat_indices`` is an int64 tensor of flat indices into ``param.view(-1)``, or
    ``None`` for a dense piece, whose destination is ``dense`` (a strided view) and whose
    ``values`` have ``dense.sizes``. ``relative`` is the patch's flag (int16 bit differences).

    Staged (compact) pieces, made by :func:`~vllm_deltasync.server.worker.apply.prepare`,
    carry int32 indices relative to ``base``: the flat index of element ``i`` is
    ``base + indices[i]``, and ``span`` bounds them (every ``indices[i] < span <= 2**31``).
    Pieces from :meth:`ShardMap.translate` have ``base`` 0 and int64 indices.
    """

    dense: DenseView | None
    relative: bool
    base: int
    span: int | None

    def __new__(
        cls,
        param: torch.Tensor,
        indices: torch.Tensor | None,
        values: torch.Tensor,
        *,
        dense: DenseView | None = None,
        relative: bool = False,
        base: int = 0,
        span: int | None = None,
    ) -> Piece:
        self = super().__new__(cls, (param, indices, values))
        self.dense = dense
        self.relative = relative
        self.base = base
        self.span = span
        return self

    @property
    def param(self) -> torch.Tensor:
        return self[0]  # type: ignore[no-any-return]

    @property
    def indices(self) -> torch.Tensor | None:
        return self[1]  # type: ignore[no-any-return]

    @property
    def values(self) -> torch.Tensor:
        return self[2]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Target:
    """One block of one checkpoint tensor on this rank, bound to its runtime parameter.

    ``block`` is in the loaders' layout of the parameter; ``layout`` (None: the same as the
    runtime layout) maps that to where the kernel keeps each element (``layouts.py``).
    """

    param_name: str
    param: torch.Tensor
    block: Block
    layout: Layout | None = None

    def runtime_indices(self, loader_indices: torch.Tensor) -> torch.Tensor:
        """Flat runtime indices of flat loader-layout indices of this parameter."""
        return loader_indices if self.layout is None else self.layout.map(loader_indices)

    def dst_indices(self) -> torch.Tensor:
        """Runtime flat index of every element of the block, in multi-index order."""
        return self.runtime_indices(self.block.dst_indices())


class ShardMap:
    """Where each checkpoint tensor's elements live in this rank's runtime parameters."""

    def __init__(
        self,
        targets: Mapping[str, list[Target]],
        checkpoint_params: Mapping[str, tuple[tuple[int, ...], str]],
        ignored: Mapping[str, str] | None = None,
        covered_by: Mapping[str, str] | None = None,
    ) -> None:
        self._targets = {name: list(ts) for name, ts in targets.items()}
        self._shapes = {n: (tuple(s), d) for n, (s, d) in checkpoint_params.items()}
        self.ignored: dict[str, str] = dict(ignored or {})
        """Checkpoint names this rank deliberately does not write, with the reason."""
        self.covered_by: dict[str, str] = dict(covered_by or {})
        """Tied names -> the checkpoint name whose placement holds the same parameter."""

    # ----------------------------------------------------------------- building
    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        checkpoint_params: Mapping[str, tuple[tuple[int, ...], str]],
        layouts: Mapping[str, LayoutSpec] | None = None,
        *,
        loader: Loader,
    ) -> ShardMap:
        """Probe the model's loaders (``loader``: the serving engine's, ``server/vllm/
        loaders.py``) once per checkpoint name (see the module docstring).

        ``checkpoint_params`` maps each checkpoint name to ``(shape, dtype name)``.
        ``layouts``: runtime parameters a kernel rearranged after loading, by parameter name,
        each with its learned layout (``layouts.py``). The loaders are probed against a
        stand-in of the loader shape, and the blocks are bound to the live parameter through
        the layout. Raises ApplyError naming every checkpoint tensor that cannot be placed.
        """
        layouts = dict(layouts or {})
        with standins(model, layouts):
            placed, unplaced = probe_model(model, checkpoint_params, loader)
        params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        params.update(model.named_buffers(remove_duplicate=False))
        targets = {
            name: [Target(pn, params[pn], b, layout_of(layouts, pn)) for pn, b in blocks]
            for name, blocks in placed.items()
        }
        ignored, covered, errors = classify_unplaced(unplaced, placed, params, model)
        for name, first in duplicates(placed, params).items():
            del targets[name]
            covered[name] = first
            ignored[name] = f"tied: writes exactly where {first!r} does"
        errors += _overlaps(targets)
        if errors:
            raise ApplyError(
                f"{len(errors)} checkpoint tensor(s) cannot be placed in this model: "
                + "; ".join(errors)
                + ". Check that the bucket was published for this model architecture."
            )
        return cls(targets, checkpoint_params, ignored, covered)

    # ---------------------------------------------------------------- queries
    @property
    def names(self) -> list[str]:
        """Every checkpoint name the map was built for."""
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[0]

    def targets(self, name: str) -> list[Target]:
        """Where a checkpoint tensor lands on this rank (0..n blocks; [] for ignored names)."""
        self._entry(name)
        return list(self._targets.get(name, ()))

    def _entry(self, name: str) -> tuple[tuple[int, ...], str]:
        try:
            return self._shapes[name]
        except KeyError:
            raise ApplyError(
                f"checkpoint tensor {name!r} is not in the parameter set this shard map was "
                "built for; rebuild the map for this checkpoint"
            ) from None

    # -------------------------------------------------------------- translate
    def translate(self, patch: TensorPatch) -> list[Piece]:
        """Pieces of ``patch`` that belong to this rank, in local flat parameter coordinates."""
        shape, dtype = self._entry(patch.name)
        numel = _check_patch(patch, shape, dtype)
        if patch.name in self.ignored:
            return []
        pieces: list[Piece] = []
        for target in self._targets.get(patch.name, ()):
            _check_param(patch, target, dtype)
            if patch.indices is not None:
                piece = _sparse_piece(target, patch.indices, patch.values, patch.relative)
            elif patch.offset == 0 and patch.values.numel() == numel:
                piece = _dense_piece(target, patch.values, patch.relative)
            else:
                piece = _run_piece(target, patch.offset, patch.values, patch.relative)
            if piece is not None:
                pieces.append(piece)
        return pieces

    # ---------------------------------------------------------- serialisation
    def to_json(self) -> str:
        """The blocks, parameter names and ignore records (no tensors), as JSON."""
        return json.dumps(
            {
                "checkpoint_params": {n: [list(s), d] for n, (s, d) in self._shapes.items()},
                "targets": {
                    n: [{"param": t.param_name, **asdict(t.block)} for t in ts]
                    for n, ts in self._targets.items()
                },
                "params": {
                    t.param_name: [list(t.param.shape), str(t.param.dtype).removeprefix("torch.")]
                    for ts in self._targets.values()
                    for t in ts
                },
                "ignored": self.ignored,
                "covered_by": self.covered_by,
            }
        )

    @classmethod
    def from_json(cls, data: str, params: Mapping[str, torch.Tensor]) -> ShardMap:
        """Rebuild a map saved by :meth:`to_json`, binding blocks to ``params`` by name."""
        raw = json.loads(data)
        targets: dict[str, list[Target]] = {}
        for name, items in raw["targets"].items():
            targets[name] = []
            for item in items:
                pname = item.pop("param")
                want = tuple(raw["params"][pname][0])
                if pname not in params or tuple(params[pname].shape) != want:
                    raise ApplyError(
                        f"shard map for {name!r} needs parameter {pname!r} of shape {want}"
                    )
                block = Block(
                    tuple(item["sizes"]), tuple(item["src_strides"]), int(item["src_offset"]),
                    tuple(item["dst_strides"]), int(item["dst_offset"]),
                )
                targets[name].append(Target(pname, params[pname], block))
        shapes = {n: (tuple(s), d) for n, (s, d) in raw["checkpoint_params"].items()}
        return cls(targets, shapes, raw["ignored"], raw["covered_by"])


def _overlaps(targets: Mapping[str, list[Target]]) -> list[str]:
    """Errors for two checkpoint names writing the same parameter element."""
    spans: dict[int, list[tuple[int, int, str, Target]]] = {}
    for name, ts in targets.items():
        for t in ts:
            lo = t.block.dst_offset
            spans.setdefault(id(t.param), []).append((lo, lo + t.block.dst_extent, name, t))
    errors = []
    for items in spans.values():
        items.sort(key=lambda item: item[0])
        for (_, hi_a, name_a, a), (lo_b, _, name_b, b) in zip(items, items[1:], strict=False):
            if lo_b <= hi_a and name_a != name_b and _share_elements(a.block, b.block):
                errors.append(f"{name_a!r} and {name_b!r} both write {a.param_name!r}")
    return errors


def _share_elements(a: Block, b: Block) -> bool:
    return bool(torch.isin(a.dst_indices(), b.dst_indices()).any())


def _check_patch(patch: TensorPatch, shape: tuple[int, ...], dtype: str) -> int:
    if tuple(patch.shape) != shape:
        raise ApplyError(
            f"patch for {patch.name!r} has shape {tuple(patch.shape)}, the checkpoint tensor "
            f"is {shape}"
        )
    numel = 1
    for s in shape:
        numel *= s
    want = torch.int16 if patch.relative else getattr(torch, dtype)
    if patch.values.dtype != want:
        raise ApplyError(
            f"patch for {patch.name!r} carries {patch.values.dtype} values, expected {want}"
        )
    if patch.indices is None:
        if patch.offset < 0 or patch.offset + patch.values.numel() > numel:
            raise ApplyError(f"dense run of {patch.name!r} exceeds the tensor's {numel} elements")
        return numel
    idx = patch.indices
    if idx.dtype != torch.int64 or idx.dim() != 1 or idx.numel() != patch.values.numel():
        raise ApplyError(
            f"patch for {patch.name!r}: indices must be 1-D int64 with one per value "
            f"(got {idx.dtype}, {idx.numel()} indices, {patch.values.numel()} values)"
        )
    if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= numel):
        raise ApplyError(f"patch for {patch.name!r}: indices outside [0, {numel})")
    if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise ApplyError(f"patch for {patch.name!r}: indices are not strictly increasing")
    return numel


def _check_param(patch: TensorPatch, target: Target, dtype: str) -> None:
    if patch.relative and target.param.dtype != getattr(torch, dtype):
        raise ApplyError(
            f"relative patch for {patch.name!r} needs a {dtype} parameter, "
            f"{target.param_name!r} is {target.param.dtype}"
        )


def _sparse_piece(
    target: Target, indices: torch.Tensor, values: torch.Tensor, relative: bool
) -> Piece | None:
    b = target.block
    lo, hi = b.src_offset, b.src_offset + b.src_extent
    a = int(torch.searchsorted(indices, lo))
    z = int(torch.searchsorted(indices, hi, right=True))
    if z <= a:
        return None
    sub, vals = indices[a:z], values[a:z]
    if len(b.sizes) == 1 and b.src_strides[0] == 1:  # one range: a shift (and a scale)
        d = b.dst_strides[0]
        if d == 1:  # no copy when the block maps onto itself (TP=1: most parameters)
            shifted = sub if b.dst_offset == lo else sub + (b.dst_offset - lo)
        else:
            shifted = (sub - lo) * d + b.dst_offset
        return Piece(target.param, target.runtime_indices(shifted), vals, relative=relative)
    rest = sub - lo
    local: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    for k, (n, s, d) in enumerate(zip(b.sizes, b.src_strides, b.dst_strides, strict=True)):
        q = torch.div(rest, s, rounding_mode="floor") if s != 1 else rest
        if k:
            keep = q < n if keep is None else keep & (q < n)
        if s != 1:
            rest = rest - q * s
        local = q * d if local is None else local + (q * d if d != 1 else q)
    if b.src_strides[-1] != 1:
        keep = rest == 0 if keep is None else keep & (rest == 0)
    assert local is not None
    local = local + b.dst_offset if b.dst_offset else local
    if keep is not None:
        local, vals = local[keep], vals[keep]
        if local.numel() == 0:
            return None
    return Piece(target.param, target.runtime_indices(local), vals, relative=relative)


def _dense_piece(target: Target, values: torch.Tensor, relative: bool) -> Piece:
    b = target.block
    values = values.contiguous()
    view = values.as_strided(b.sizes, b.src_strides, values.storage_offset() + b.src_offset)
    if target.layout is not None:  # rearranged by the kernel: a scatter to runtime indices
        return Piece(target.param, target.dst_indices(), view.reshape(-1), relative=relative)
    dense = DenseView(b.sizes, b.dst_strides, b.dst_offset)
    return Piece(target.param, None, view, dense=dense, relative=relative)


def _run_piece(target: Target, offset: int, values: torch.Tensor, relative: bool) -> Piece | None:
    """A dense run covering part of the tensor: a slice when the block is one range."""
    b = target.block
    lo = max(offset, b.src_offset)
    hi = min(offset + values.numel(), b.src_offset + b.src_extent + 1)
    if hi <= lo:
        return None
    if len(b.sizes) == 1 and b.src_strides[0] == 1 and target.layout is None:
        dense = DenseView((hi - lo,), b.dst_strides, b.dst_offset + (lo - b.src_offset) * b.dst_strides[0])
        return Piece(target.param, None, values[lo - offset : hi - offset], dense=dense, relative=relative)
    idx = torch.arange(lo, hi, device=values.device)
    return _sparse_piece(target, idx, values[lo - offset : hi - offset], relative)


def translate_all(shardmap: ShardMap, patches: Iterable[TensorPatch]) -> list[Piece]:
    """Translate several patches; convenience for callers staging one step."""
    out: list[Piece] = []
    for patch in patches:
        out.extend(shardmap.translate(patch))
    return out


__all__ = ["Block", "DenseView", "Piece", "ShardMap", "Target", "translate_all"]

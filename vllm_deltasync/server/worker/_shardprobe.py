"""The probe behind :meth:`vllm_deltasync.server.worker.shardmap.ShardMap.from_model` (see that module's doc).

Runs the model's own ``load_weights`` with a meta-device probe per checkpoint name under a
``TorchDispatchMode`` that records each ``copy_`` from a probe view into a parameter as an
affine :class:`Block` and skips every write into the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_deltasync.errors import ApplyError

_ATEN = torch.ops.aten
_COPY_OPS = (_ATEN.clone.default, _ATEN._to_copy.default)
Geometry = tuple[int, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Block:
    """One affine piece: checkpoint view -> runtime parameter view, both in flat coordinates.

    Element ``m`` (a multi-index below ``sizes``) is checkpoint flat index
    ``src_offset + sum(m * src_strides)`` and parameter flat index
    ``dst_offset + sum(m * dst_strides)``. Dims are sorted by decreasing source stride and
    nested (each stride exceeds the reach of the later dims), so the inverse is a greedy divide.
    """

    sizes: tuple[int, ...]
    src_strides: tuple[int, ...]
    src_offset: int
    dst_strides: tuple[int, ...]
    dst_offset: int

    @property
    def src_extent(self) -> int:
        """Last source flat index minus the first."""
        return sum((n - 1) * s for n, s in zip(self.sizes, self.src_strides, strict=True))

    @property
    def dst_extent(self) -> int:
        return sum((n - 1) * d for n, d in zip(self.sizes, self.dst_strides, strict=True))

    def src_indices(self) -> torch.Tensor:
        """Checkpoint flat index of every element of the block (int64, in multi-index order)."""
        return _strided_indices(self.src_offset, self.sizes, self.src_strides)

    def dst_indices(self) -> torch.Tensor:
        """Parameter flat index of every element of the block (int64, in multi-index order)."""
        return _strided_indices(self.dst_offset, self.sizes, self.dst_strides)

    @property
    def numel(self) -> int:
        out = 1
        for n in self.sizes:
            out *= n
        return out

    @classmethod
    def normalised(
        cls, sizes: Iterable[int], src: Geometry, dst: Geometry
    ) -> Block | None:
        """Drop size-1 dims, sort by source stride, merge contiguous dims; None if empty."""
        dims = [(n, s, d) for n, s, d in zip(sizes, src[2], dst[2], strict=True) if n != 1]
        if any(n == 0 for n, _, _ in dims):
            return None
        if any(s <= 0 or d <= 0 for _, s, d in dims):
            raise ValueError("broadcast, repeated or reversed elements")
        dims.sort(key=lambda t: -t[1])
        merged = dims[:1] or [(1, 1, 1)]
        for n, s, d in dims[1:]:
            pn, ps, pd = merged[-1]
            if ps == s * n and pd == d * n:
                merged[-1] = (pn * n, s, d)
            else:
                merged.append((n, s, d))
        block = cls(
            tuple(m[0] for m in merged), tuple(m[1] for m in merged), src[0],
            tuple(m[2] for m in merged), dst[0],
        )
        if not (_nested(block.sizes, block.src_strides) and _nested(block.sizes, block.dst_strides)):
            raise ValueError("overlapping elements")
        return block


def _nested(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    order = sorted(range(len(sizes)), key=lambda k: -strides[k])
    reach = 0
    for k in reversed(order):
        if strides[k] <= reach:
            return False
        reach += (sizes[k] - 1) * strides[k]
    return True


class _ParamIndex:
    """Finds the parameter (or buffer) a tensor's storage belongs to; guards against edits."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.saved: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        named = [*model.named_parameters(), *model.named_buffers()]
        for name, t in named:
            self.saved.append((name, t, t.data))
            if t.device.type != "meta" and t.numel():
                self.by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((name, t))

    def owner(self, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if t.device.type == "meta":
            return None
        lo = t.storage_offset()
        hi = lo + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        for name, p in self.by_storage.get(t.untyped_storage().data_ptr(), ()):
            if p.storage_offset() <= lo and hi < p.storage_offset() + p.numel():
                return name, p
        return None

    def restore(self, checkpoint_name: str) -> None:
        """Undo any ``param.data = ...`` a loader did; ApplyError naming the tensor if so."""
        changed = []
        for name, t, data in self.saved:
            if t.data_ptr() != data.data_ptr() or t.shape != data.shape or t.dtype != data.dtype:
                t.data = data
                changed.append(name)
        if changed:
            raise ApplyError(
                f"loading {checkpoint_name!r} replaced the storage of {changed}; in-place updates "
                "need loaders that copy into existing parameters"
            )


class _Recorder(TorchDispatchMode):
    """Records where meta probes' elements are copied; skips every write into the model.

    ``probes`` maps checkpoint names to their probes: one name (probing one name at a time)
    or all of them (one batched ``load_weights`` call). Each probe's storage names it, so a
    copy is attributed to the name whose probe (or converted copy of it) is the source."""

    def __init__(self, probes: Mapping[str, torch.Tensor], index: _ParamIndex) -> None:
        super().__init__()
        self.index = index
        self.origin: dict[int, str] = {p.untyped_storage()._cdata: n for n, p in probes.items()}
        self.name = next(iter(probes)) if len(probes) == 1 else "<batch>"
        self.keep: list[torch.Tensor] = list(probes.values())
        self.aliases: dict[int, tuple[Geometry, Geometry]] = {}
        self.tainted: dict[int, str] = {}
        self.blocks: dict[str, list[tuple[str, Block]]] = {n: [] for n in probes}
        self.touched: set[str] = set()
        """Names a probe copy reached a parameter for (possibly of zero elements: an empty
        vocab shard)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # the probe runs eagerly at start, never under torch.compile: skip torch's
        # dynamo-disabling wrapper around every dispatched op (a third of the probe's time)
        return False

    def error(self, what: str) -> ApplyError:
        return ApplyError(f"cannot place checkpoint tensor {self.name!r}: the loader {what}")

    def name_of(self, t: torch.Tensor) -> str | None:
        """The checkpoint name a meta tensor derives from (a view or converted copy of its
        probe), or None."""
        return self.origin.get(t.untyped_storage()._cdata) if t.device.type == "meta" else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _ATEN.copy_.default:
            return self._copy(args[0], args[1])
        if func.is_view and not kwargs and len(args) and isinstance(args[0], torch.Tensor) \
                and args[0].device.type == "meta":
            return func(*args)  # a view of a probe (narrow, select, unbind, ...): geometry only
        metas = [a for a in tensors_of(args, kwargs) if a.device.type == "meta"]
        written = _written(func, args, kwargs)
        if written and any(self.index.owner(w) is not None for w in written):
            if metas:
                raise self.error(f"writes it into a parameter through {func}")
            return written[0]  # e.g. fill_ of vocab padding: never touch live weights
        if any(w.device.type == "meta" for w in written):
            raise self.error(f"modifies it in place with {func}")
        if func in _COPY_OPS and metas and kwargs.get("device") is not None:
            kwargs = {**kwargs, "device": torch.device("meta")}  # .to(param.device): stay on meta
        out = func(*args, **kwargs)
        if metas and not func.is_view:
            self._derive(func, metas, out)
        return out

    def _derive(self, func: Any, metas: list[torch.Tensor], out: Any) -> None:
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(o, torch.Tensor) and o.device.type == "meta"]
        source = next((n for n in map(self.name_of, metas) if n is not None), None)
        for o in outs:
            self.keep.append(o)
            sid = o.untyped_storage()._cdata
            if source is not None:
                self.origin[sid] = source
            if func in _COPY_OPS and len(metas) == 1 and metas[0].shape == o.shape:
                try:
                    self.aliases[sid] = (_geom(o), self._geometry(metas[0]))
                    continue
                except ApplyError:
                    pass
            self.tainted[sid] = str(func)

    def _geometry(self, t: torch.Tensor) -> Geometry:
        sid = t.untyped_storage()._cdata
        if sid in self.aliases:
            layout, base = self.aliases[sid]
            if _geom(t) == layout:
                return base
            raise self.error("views a converted copy of it in a way the shard map cannot follow")
        if sid in self.tainted:
            raise self.error(f"transforms its values with {self.tainted[sid]}")
        if sid in self.origin:
            return _geom(t)
        raise self.error("copies from a tensor that does not come from it")

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        owner = self.index.owner(dst)
        if owner is None:
            if src.device.type == "meta" or dst.device.type == "meta":
                raise self.error("copies it into a temporary tensor, not a parameter")
            return _ATEN.copy_.default(dst, src)  # type: ignore[no-any-return]
        if src.device.type != "meta":
            return dst  # a write not derived from the checkpoint tensor: skipped
        if tuple(src.shape) != tuple(dst.shape):
            raise self.error(f"broadcasts shape {tuple(src.shape)} into {tuple(dst.shape)}")
        pname, param = owner
        name = self.name_of(src)
        if name is None:
            raise self.error("copies from a tensor that does not come from it")
        self.touched.add(name)
        if not param.is_contiguous():
            raise self.error(f"writes into non-contiguous parameter {pname!r}")
        dst_geom: Geometry = (
            int(dst.storage_offset() - param.storage_offset()), (), tuple(dst.stride())
        )
        try:
            block = Block.normalised(dst.shape, self._geometry(src), dst_geom)
        except ValueError as exc:
            raise self.error(f"writes {exc} into {pname!r}") from exc
        if block is not None:
            self.blocks[name].append((pname, block))
        return dst


def _geom(t: torch.Tensor) -> Geometry:
    return (int(t.storage_offset()), tuple(int(n) for n in t.shape), tuple(t.stride()))


def tensors_of(args: Any, kwargs: Any) -> list[torch.Tensor]:
    flat = [*args, *kwargs.values()]
    out = []
    for a in flat:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """Tensors the op writes to, from the schema's alias annotations (cached per op)."""
    writes = _WRITES.get(func)
    if writes is None:
        writes = tuple((i, arg.name) for i, arg in enumerate(func._schema.arguments)
                       if arg.alias_info is not None and arg.alias_info.is_write)
        _WRITES[func] = writes
    out = []
    for i, name in writes:
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out


def _dtype(name: str, dtype: str) -> torch.dtype:
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ApplyError(f"checkpoint tensor {name!r} has unknown dtype {dtype!r}")
    return value


DECLINED = "declined by the loader of "
"""Start of the unplaced reason of a name whose parameter's loader answered False and wrote
nothing: vLLM's way of saying the tensor belongs to another rank (an expert held by another
expert-parallel rank). ``shardmap.py`` records such names as not on this rank."""


class DeclineLog(Protocol):
    """What the loader's decline log (``Loader.declines``) records while it is entered."""

    declined: list[tuple[str, tuple[Any, ...]]]
    """(parameter, the loader's tensor arguments) of each call that answered False."""

    def __enter__(self) -> DeclineLog: ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass(frozen=True)
class Loader:
    """What the probe needs of the serving engine's loading machinery (vLLM's, handed in by
    ``server/vllm/loaders.py``: this module touches no vLLM attribute)."""

    load_weights: Callable[[torch.nn.Module], Callable[[Iterable[tuple[str, torch.Tensor]]], Any]]
    """The model's loader of checkpoint-named tensors (ApplyError when it has none)."""
    declines: Callable[[torch.nn.Module], DeclineLog]
    """A context that records the parameters whose loader declined a tensor."""


def probe_model(
    model: torch.nn.Module, checkpoint_params: Mapping[str, tuple[tuple[int, ...], str]],
    loader: Loader,
) -> tuple[dict[str, list[tuple[str, Block]]], dict[str, str]]:
    """Run the model's loader on meta probes: (placed blocks, unplaced reasons).

    First one ``load_weights`` call with every name (per-call overhead of the loaders, e.g.
    their expert tables, is paid once); if anything in it fails, every name is probed alone,
    so the names that cannot be placed are reported each with its own reason. A name whose
    only loader calls answered False (:data:`DECLINED`) is unplaced with that reason; the
    caller decides what it means.

    Expert families (``...experts.<e>.<rest>`` for ``e`` = 0..n-1, tens of thousands of names
    in real MoE checkpoints) are probed through three members: experts 0, 1 and n-1. When
    their blocks differ only by a constant parameter offset per expert and the parameter holds
    exactly the n experts (no expert parallelism), the others are placed by that stride (the
    startup proof's check 1 then reads every one of them back); otherwise the whole family is
    probed."""
    index = _ParamIndex(model)
    load_weights = loader.load_weights(model)
    probes = {name: torch.empty(tuple(shape), dtype=_dtype(name, dtype), device="meta")
              for name, (shape, dtype) in checkpoint_params.items()}
    families = expert_families(probes)
    inferred = {name for family in families for _, name in family[2:-1]}
    with loader.declines(model) as declines:
        placed, unplaced = _probe(load_weights, {n: p for n, p in probes.items()
                                                 if n not in inferred}, index, declines)
        numel = {n: p.numel() for n, p in model.named_parameters(remove_duplicate=False)}
        rest = {name: probes[name] for family in families
                if not _extrapolate(family, placed, numel) for _, name in family[2:-1]}
        if rest:
            more, refused = _probe(load_weights, rest, index, declines)
            placed.update(more)
            unplaced.update(refused)
    return placed, unplaced


_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..+)$")
MIN_FAMILY = 4
"""Smallest expert family placed by stride (three members are probed)."""


def expert_families(names: Iterable[str]) -> list[list[tuple[int, str]]]:
    """Names ``<prefix>experts.<e>.<rest>`` grouped by prefix and rest, sorted by ``e``; only
    groups whose ``e`` run 0..n-1 with n >= :data:`MIN_FAMILY`."""
    groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for name in names:
        m = _EXPERT.match(name)
        if m:
            groups.setdefault((m.group(1), m.group(3)), []).append((int(m.group(2)), name))
    out = []
    for members in groups.values():
        members.sort()
        if len(members) >= MIN_FAMILY and [e for e, _ in members] == list(range(len(members))):
            out.append(members)
    return out


def _extrapolate(family: list[tuple[int, str]], placed: dict[str, list[tuple[str, Block]]],
                 numel: Mapping[str, int]) -> bool:
    """Place the members between the probed ones (experts 0, 1 and n-1) by their constant
    stride; False (nothing placed) unless the probed blocks say so exactly."""
    n = len(family)
    first, second, last = (placed.get(family[i][1]) for i in (0, 1, n - 1))
    if not first or not second or not last or not len(first) == len(second) == len(last):
        return False
    stride = None
    for (p0, b0), (p1, b1), (pl, bl) in zip(first, second, last, strict=True):
        d = b1.dst_offset - b0.dst_offset
        if (not p0 == p1 == pl or d <= 0 or (stride is not None and d != stride)
                or replace(b1, dst_offset=b0.dst_offset) != b0
                or replace(bl, dst_offset=b0.dst_offset) != b0
                or bl.dst_offset != b0.dst_offset + (n - 1) * d
                or numel.get(p0) != n * d):
            return False
        stride = d
    assert stride is not None
    for e, name in family[2:-1]:
        placed[name] = [(p, replace(b, dst_offset=b.dst_offset + e * stride)) for p, b in first]
    return True


def _probe(load_weights: Any, probes: Mapping[str, torch.Tensor], index: _ParamIndex,
           declines: DeclineLog) -> tuple[dict[str, list[tuple[str, Block]]], dict[str, str]]:
    """One batched call for ``probes``; name by name if it failed."""
    if len(probes) > 1:
        batch = _probe_batch(load_weights, probes, index, declines)
        if batch is not None:
            return batch
    placed: dict[str, list[tuple[str, Block]]] = {}
    unplaced: dict[str, str] = {}
    for name, probe in probes.items():
        recorder = _Recorder({name: probe}, index)
        declines.declined.clear()
        try:
            with torch.no_grad(), recorder:
                load_weights(iter([(name, probe)]))
        except ApplyError:
            raise
        except Exception as exc:
            unplaced[name] = f"the loader refused it ({type(exc).__name__}: {str(exc)[:160]})"
            continue
        finally:
            index.restore(name)
        _classify(name, recorder, [p for p, _ in declines.declined], placed, unplaced)
    return placed, unplaced


def _probe_batch(load_weights: Any, probes: Mapping[str, torch.Tensor], index: _ParamIndex,
                 declines: DeclineLog
                 ) -> tuple[dict[str, list[tuple[str, Block]]], dict[str, str]] | None:
    """Every name in one ``load_weights`` call; None when anything failed (then the caller
    probes name by name for exact reasons)."""
    recorder = _Recorder(probes, index)
    declines.declined.clear()
    try:
        with torch.no_grad(), recorder:
            load_weights(iter(probes.items()))
    except Exception:  # noqa: BLE001 - retried name by name, which reports it
        return None
    finally:
        try:
            index.restore("<batch>")
        except ApplyError:
            return None  # noqa: B012 - the per-name pass names the tensor
    declined: dict[str, list[str]] = {}
    for pname, tensors in declines.declined:
        for name in {n for n in map(recorder.name_of, tensors) if n is not None}:
            declined.setdefault(name, []).append(pname)
    placed: dict[str, list[tuple[str, Block]]] = {}
    unplaced: dict[str, str] = {}
    for name in probes:
        _classify(name, recorder, declined.get(name, []), placed, unplaced)
    return placed, unplaced


def _classify(name: str, recorder: _Recorder, declined: list[str],
              placed: dict[str, list[tuple[str, Block]]], unplaced: dict[str, str]) -> None:
    if name in recorder.touched:
        placed[name] = recorder.blocks[name]
    elif declined:
        unplaced[name] = DECLINED + ", ".join(sorted(set(declined)))
    else:
        unplaced[name] = "load_weights wrote nothing for it"


def _strided_indices(offset: int, sizes: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    out = torch.full(sizes, offset, dtype=torch.int64)
    for k, (n, stride) in enumerate(zip(sizes, strides, strict=True)):
        shape = [1] * len(sizes)
        shape[k] = n
        out += (torch.arange(n, dtype=torch.int64) * stride).view(shape)
    return out.reshape(-1)

"""Runtime layouts: parameters a kernel rearranged after ``load_weights``, learned by probing.

Some kernels transform a parameter after the checkpoint was loaded into it. vLLM's CPU MoE
kernel, for one, pads the per-rank intermediate size to a multiple of 32 and repacks
``w13_weight`` / ``w2_weight`` into its grouped-GEMM tile order (``prepack_moe_weight``). The
loaders (what :mod:`shardmap` probes) write the *loader layout*; the kernel reads the *runtime
layout*. A write in loader coordinates then lands on the wrong elements while every digest read
back through the same map agrees with what was written (REFERENCE §3).

When such a transform moves bit patterns without changing them (a permutation, or zero padding
plus a permutation), its map from loader index to runtime index is learned here, once at
start, by running the kernel's own after-load processing on a *coded* tensor: element ``i``
of a loader-layout tensor holds the code ``i + 1`` (two passes of 16 bits each, as bf16 bit
patterns), the transform runs, and each runtime element's code says which loader element it
came from (0: padding). A second run with a different coding must give the same map, or the
transform is refused (it is not a pure rearrangement). :class:`Layout` stores the map compactly:
it finds the smallest *period* ``P`` such that loader element ``i + P`` goes where element
``i`` goes shifted by ``P'`` (for the CPU MoE repack: one tile of 16 rows, or one expert when
padding breaks the tiles), and keeps one period of offsets (uint16 when they fit, else int32).
Layouts are cached by (kernel, loader shape, runtime shape, dtype), so every layer with the
same shapes shares one.

This module imports no vLLM: the transform is a callable the vLLM glue
(``server/vllm/worker.py``) builds from the model's own layer objects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vllm_deltasync.errors import ApplyError

Transform = Callable[[torch.Tensor], torch.Tensor]
"""Loader-layout tensor -> runtime-layout tensor (the kernel's own after-load processing)."""


@dataclass(frozen=True)
class Layout:
    """Loader flat index -> runtime flat index of one parameter kind, stored by period.

    Loader index ``i = q * period + r`` lands at runtime index ``q * runtime_period +
    offsets[r]``. Runtime elements no loader element reaches are padding (``padding``).
    """

    kernel: str
    loader_shape: tuple[int, ...]
    runtime_shape: tuple[int, ...]
    period: int
    runtime_period: int
    offsets: torch.Tensor
    """One period of runtime offsets (uint16 stored as int16 when they fit, else int32)."""
    padding: int
    """Runtime elements that hold no checkpoint element (zero padding)."""

    @property
    def nbytes(self) -> int:
        return int(self.offsets.numel() * self.offsets.element_size())

    def map(self, indices: torch.Tensor) -> torch.Tensor:
        """Runtime flat indices of loader flat ``indices`` (int64, same order)."""
        offsets = self.offsets.to(indices.device) if self.offsets.device != indices.device \
            else self.offsets
        if self.period == _numel(self.loader_shape) and self.runtime_period == _numel(
                self.runtime_shape):
            return _widen(offsets[indices])
        q = torch.div(indices, self.period, rounding_mode="floor")
        r = indices - q * self.period
        return q * self.runtime_period + _widen(offsets[r])

    @property
    def identity(self) -> bool:
        """True when the kernel kept the loader layout (nothing to translate)."""
        if self.loader_shape != self.runtime_shape or self.period != self.runtime_period:
            return False
        return bool(torch.equal(_widen(self.offsets), torch.arange(self.period)))

    def describe(self) -> str:
        return (f"{self.kernel} {list(self.loader_shape)} -> {list(self.runtime_shape)}: period "
                f"{self.period} ({self.nbytes} bytes), {self.padding} padding elements")


def _widen(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.int16:
        return x.to(torch.int64) & 0xFFFF
    return x.to(torch.int64)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _coded_run(transform: Transform, shape: tuple[int, ...], dtype: torch.dtype,
               codes: torch.Tensor) -> torch.Tensor:
    """Runtime tensor of codes (int64; 0 = padding) after ``transform`` of ``codes`` + 1."""
    if torch.empty((), dtype=dtype).element_size() != 2:
        raise ApplyError(f"learned layouts need a 16-bit dtype, got {dtype}")
    coded = codes + 1
    parts = []
    for shift in (0, 16):
        bits = ((coded >> shift) & 0xFFFF).to(torch.int32)
        bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)
        out = transform(bits.view(dtype).view(shape).contiguous())
        if out.dtype != dtype:
            raise ApplyError(f"the transform changed the dtype ({dtype} -> {out.dtype})")
        parts.append(_widen(out.detach().contiguous().view(torch.int16).reshape(-1)))
        if coded.max() < 1 << 16:  # one pass is enough; the high half is all zero
            parts.append(torch.zeros_like(parts[0]))
            shape_out = tuple(out.shape)
            break
        shape_out = tuple(out.shape)
    runtime = parts[0] | (parts[1] << 16)
    return runtime.view(shape_out)


def learn_layout(kernel: str, transform: Transform, loader_shape: Sequence[int],
                 dtype: torch.dtype) -> Layout:
    """Learn the map of ``transform`` on ``loader_shape`` (see the module docstring).

    Raises :class:`ApplyError` when the transform is not a rearrangement of bit patterns with
    zero padding, or when a second coding disagrees with the first.
    """
    shape = tuple(int(s) for s in loader_shape)
    n = _numel(shape)
    codes = torch.arange(n, dtype=torch.int64)
    runtime = _coded_run(transform, shape, dtype, codes)
    flat = runtime.reshape(-1)
    src = flat - 1  # loader index of each runtime element, -1 for padding
    real = src >= 0
    found = src[real]
    if found.numel() != n or not torch.equal(torch.sort(found).values, codes):
        raise ApplyError(
            f"{kernel}: the after-load transform of {list(shape)} is not a rearrangement of the "
            "loaded elements (values changed, lost or repeated); writes in checkpoint "
            "coordinates cannot follow it"
        )
    if flat.numel() - n and bool((flat[~real] != 0).any()):
        raise ApplyError(f"{kernel}: the transform fills new elements with non-zero values")
    forward = torch.empty(n, dtype=torch.int64)
    forward[found] = torch.nonzero(real).reshape(-1)
    # a second coding (codes reversed) must give the same map: a pure rearrangement
    reverse = torch.arange(n - 1, -1, -1, dtype=torch.int64)
    again = _coded_run(transform, shape, dtype, reverse).reshape(-1)
    expect = torch.zeros_like(flat)
    expect[forward] = reverse[torch.arange(n)] + 1
    if not torch.equal(again, expect):
        raise ApplyError(f"{kernel}: the after-load transform of {list(shape)} depends on the "
                         "values (two codings disagree); refused")
    return _compress(kernel, shape, tuple(runtime.shape), forward)


def _compress(kernel: str, loader_shape: tuple[int, ...], runtime_shape: tuple[int, ...],
              forward: torch.Tensor) -> Layout:
    n, m = forward.numel(), _numel(runtime_shape)
    period, runtime_period = n, m
    for p in _divisors(n):
        if p == n:
            break
        if (p * m) % n:
            continue
        rp = p * m // n
        if int(forward[p]) != int(forward[0]) + rp:
            continue
        if torch.equal(forward[p:], forward[:-p] + rp):
            period, runtime_period = p, rp
            break
    tile = forward[:period]
    offsets = tile.to(torch.int32)
    if int(tile.max()) < 1 << 16:
        offsets = torch.where(tile >= 1 << 15, tile - (1 << 16), tile).to(torch.int16)
    return Layout(kernel, loader_shape, runtime_shape, period, runtime_period, offsets, m - n)


def _divisors(n: int) -> list[int]:
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


@dataclass
class LayoutSpec:
    """One runtime parameter whose kernel rearranged it after loading.

    ``loader_shape`` is the shape the loaders write (before the transform); ``key`` names the
    kernel and shapes, so parameters with the same key share one learned :class:`Layout`.
    ``learn_shape`` is a smaller loader shape (e.g. two experts instead of all) the transform
    is run on; the layout must then be periodic so it extends to ``loader_shape``.
    """

    param_name: str
    loader_shape: tuple[int, ...]
    kernel: str
    transform: Transform
    learn_shape: tuple[int, ...] | None = None
    layout: Layout | None = field(default=None)


class LayoutCache:
    """Learned layouts by (kernel, loader shape, runtime shape, dtype); one per distinct key."""

    def __init__(self) -> None:
        self.layouts: dict[tuple[object, ...], Layout] = {}

    def learn(self, spec: LayoutSpec, param: torch.Tensor) -> Layout:
        key = (spec.kernel, spec.loader_shape, tuple(param.shape), param.dtype)
        layout = self.layouts.get(key)
        if layout is None:
            shape = spec.learn_shape or spec.loader_shape
            layout = learn_layout(spec.kernel, spec.transform, shape, param.dtype)
            layout = _extend(layout, spec.loader_shape, tuple(param.shape))
            self.layouts[key] = layout
        spec.layout = layout
        return layout

    @property
    def nbytes(self) -> int:
        return sum(layout.nbytes for layout in self.layouts.values())


def _extend(layout: Layout, loader_shape: tuple[int, ...], runtime_shape: tuple[int, ...]) -> Layout:
    """A layout learned on a smaller leading dim, valid for the full shape when periodic."""
    if layout.loader_shape == loader_shape:
        if layout.runtime_shape != runtime_shape:
            raise ApplyError(f"{layout.kernel}: learned runtime shape {list(layout.runtime_shape)}"
                             f" but the parameter is {list(runtime_shape)}")
        return layout
    n, m = _numel(loader_shape), _numel(runtime_shape)
    ok = (n % layout.period == 0 and m % layout.runtime_period == 0
          and n // layout.period == m // layout.runtime_period
          and layout.loader_shape[1:] == loader_shape[1:]
          and layout.runtime_shape[1:] == runtime_shape[1:])
    if not ok:
        raise ApplyError(f"{layout.kernel}: the layout learned on {list(layout.loader_shape)} "
                         f"does not repeat to {list(loader_shape)} -> {list(runtime_shape)}")
    return Layout(layout.kernel, loader_shape, runtime_shape, layout.period,
                  layout.runtime_period, layout.offsets,
                  m - n)


__all__ = ["Layout", "LayoutCache", "LayoutSpec", "Transform", "learn_layout"]

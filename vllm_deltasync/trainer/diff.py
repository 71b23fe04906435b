"""The publisher's diff: which bf16 elements changed since the last published step.

The previous step's bf16 bit patterns (the *baseline*) are the only copy of the weights the
publisher keeps, and the diff updates them in place at the changed elements instead of taking
a new snapshot every step:

- **On an accelerator** (``previous_on="device"``, the default) the baseline lives on the
  parameter's own device. The compare, the gather of changed indices and values and the
  baseline update run there as torch kernels; only the changed elements cross to the host.
  It costs a bf16 copy of the local parameters in device memory.
- **On the host** (CPU parameters, or ``previous_on="host"`` for accelerator parameters) the
  baseline is a host array. The parameters are read in chunks of ``chunk_elements``: a CPU
  bf16 parameter is compared where it lives (no copy), other dtypes are rounded to bf16 one
  chunk at a time, and accelerator chunks come through one bounded pinned buffer. One fused
  pass (numba, ``nogil``; numpy where numba is missing) compares, collects the changed
  elements and writes them into the baseline.

An anchor hands the upload thread the whole baseline: a host baseline is *lent* to the job and
copied by the next diff only if the upload has not finished by then (copy on write), so an
anchor costs no second copy when uploads keep up. The torch path runs on any device: with
``device_path=True`` CPU parameters take it too, which is how CI tests the code a GPU runs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from vllm_deltasync._jit import compile_kernels, first, once

log = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 20
"""Elements per pass of the host diff (2 MiB of bf16: stays in cache between compare and gather)."""


@dataclass
class Diff:
    """One parameter's diff against the baseline, on the host."""

    changed: int
    """Elements whose bf16 bits differ from the previous step's."""
    indices: torch.Tensor | None
    """int64 sorted flat indices of the changed elements; None for a full (anchor) diff."""
    new: torch.Tensor
    """bf16: the changed elements' new values, or every element (full)."""
    old: torch.Tensor | None
    """bf16: the changed elements' previous values; None for a full diff."""
    counts: tuple[int, ...] = ()
    """``changed`` per segment between the ``cuts`` given to :meth:`Differ.diff`."""


class _Baseline:
    __slots__ = ("bits", "device", "lent")

    def __init__(self, bits: torch.Tensor, device: bool) -> None:
        self.bits = bits  # flat int16 view of the previous step's bf16 values
        self.device = device  # the torch path (bits on the parameter's device)
        self.lent: object | None = None  # the job that uploads ``bits`` as an anchor, until done


class Differ:
    """Keeps the previous step's bf16 bits per parameter and diffs new steps against them.

    Not thread-safe: one caller (the training thread). :meth:`release` may be called from the
    upload thread.
    """

    def __init__(self, *, previous_on: str = "device", chunk_elements: int = CHUNK_ELEMENTS,
                 device_path: bool = False, threads: int = 0) -> None:
        """
        Args:
            previous_on: ``"device"`` or ``"host"`` (accelerator parameters; module docstring).
            chunk_elements: elements per pass of the host diff.
            device_path: the torch path for every parameter, CPU ones included (tests).
            threads: host diffs of different parameters run on this many threads at once, the
                calling thread one of them (the fused pass releases the GIL; the training
                thread waits for them anyway); 0: one per available core, at most 4.
        """
        if previous_on not in ("device", "host"):
            raise ValueError(f"previous_on={previous_on!r} must be 'device' or 'host'")
        self.previous_on = previous_on
        self.chunk_elements = max(1024, int(chunk_elements))
        self.device_path = device_path
        self.threads = threads or min(4, _available_cores())
        self._base: dict[str, _Baseline] = {}
        self._pinned: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        # The fused pass compiles at the first delta (~0.3 s from numba's disk cache, ~1 s
        # without), not here: importing numba loads llvmlite, and vLLM 0.32's CPU platform then
        # fails to start an in-process engine in this process (its triton override scan of
        # sys.modules trips over llvmlite's function wrappers), so a trainer that starts a
        # colocated engine after its publisher must not find numba loaded by the publisher.

    def __contains__(self, name: str) -> bool:
        return name in self._base

    def clear(self) -> None:
        self._base.clear()
        self._pinned = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def diff_all(self, tensors: Mapping[str, torch.Tensor], *, full: bool, job: object = None,
                 cuts: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Diff]:
        """:meth:`diff` of every tensor, in order; host diffs on :attr:`threads` threads."""
        cuts = cuts or {}
        names = list(tensors)
        host = [n for n in names if n in self._base and not self._base[n].device
                and tensors[n].device.type == "cpu"]
        out: dict[str, Diff] = {}
        done: dict[str, Diff] = {}
        if self.threads > 1 and len(host) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="deltasync-diff")

            def run(share: list[str]) -> dict[str, Diff]:
                return {n: self.diff(n, tensors[n], full=full, job=job, cuts=cuts.get(n, ()))
                        for n in share}

            mine, *others = _shares(host, {n: tensors[n].numel() for n in host}, self.threads)
            futures = [self._pool.submit(run, share) for share in others if share]
            try:
                done.update(run(mine))  # the calling thread takes a share too
                for f in futures:
                    done.update(f.result())
            except BaseException:
                for f in futures:  # every diff has ended before the caller goes on
                    f.cancel()
                for f in futures:
                    if not f.cancelled():
                        f.exception()
                raise
        for n in names:
            out[n] = done[n] if n in done else self.diff(n, tensors[n], full=full, job=job,
                                                          cuts=cuts.get(n, ()))
        return out

    def release(self, job: object) -> None:
        """The upload of ``job`` no longer reads the baselines it was lent (upload thread)."""
        for base in list(self._base.values()):
            if base.lent is job:
                base.lent = None

    def diff(self, name: str, tensor: torch.Tensor, *, full: bool, job: object = None,
             cuts: tuple[int, ...] = ()) -> Diff:
        """Diff ``tensor`` (any floating dtype, any device) against its baseline and make the
        baseline its bf16 value. ``full``: return every element (an anchor; a new name is
        always full), lending the host baseline to ``job`` instead of copying it. ``cuts``:
        offsets that split the flat tensor into segments (a shard's blocks): the diff counts
        the changes of each (:attr:`Diff.counts`)."""
        src = tensor.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        src = src.view(-1)
        base = self._base.get(name)
        bounds = _bounds(cuts, src.numel())
        if base is None:
            first = self._first(name, src, job)
            first.counts = tuple(b - a for a, b in pairwise(bounds))
            return first
        if base.bits.numel() != src.numel():
            raise ValueError(f"tensor {name!r} has {src.numel()} elements, its baseline "
                             f"{base.bits.numel()}")
        if base.device:
            return _device_diff(base, src, full, bounds)
        if base.lent is not None:  # the previous anchor's upload still reads it: copy on write
            base.bits, base.lent = base.bits.clone(), None
        out = self._host_diff(base.bits, src, full, bounds)
        if full:
            base.lent = job
            return Diff(out.changed, None, base.bits.view(torch.bfloat16), None, out.counts)
        return out

    # ------------------------------------------------------------------ first step
    def _first(self, name: str, src: torch.Tensor, job: object) -> Diff:
        on_device = self.device_path or (src.device.type != "cpu" and self.previous_on == "device")
        if on_device:
            bits = src.to(torch.bfloat16, copy=True).view(torch.int16)
            self._base[name] = _Baseline(bits, True)
            return Diff(bits.numel(), None, bits.view(torch.bfloat16).to("cpu", copy=True), None)
        bits = torch.empty(src.numel(), dtype=torch.int16)
        for start, stop in self._chunks(src.numel()):
            bits[start:stop].copy_(self._host_chunk(src, start, stop))
        base = _Baseline(bits, False)
        base.lent = job
        self._base[name] = base
        return Diff(bits.numel(), None, bits.view(torch.bfloat16), None)

    # ------------------------------------------------------------------ host path
    def _buffers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This thread's output buffers of the fused pass, kept between calls: fresh 12 MiB
        each call would be page-faulted in again every time."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None or bufs[0].size < self.chunk_elements:
            bufs = (np.empty(self.chunk_elements, np.int64), np.empty(self.chunk_elements, np.int16),
                    np.empty(self.chunk_elements, np.int16))
            self._local.bufs = bufs
        return bufs

    def _chunks(self, n: int, bounds: tuple[int, ...] = ()) -> list[tuple[int, int]]:
        """``[0, n)`` in pieces of at most ``chunk_elements``, split at every bound too."""
        step = self.chunk_elements
        edges = sorted(set(range(0, n, step)) | set(bounds[:-1]) | {n})
        return list(pairwise(edges))

    def _host_chunk(self, src: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``src[start:stop]`` as host int16 bf16 bits (a view where it already is)."""
        part = src[start:stop]
        if part.device.type == "cpu":
            return (part if part.dtype == torch.bfloat16 else part.to(torch.bfloat16)).view(torch.int16)
        part = part.to(torch.bfloat16)  # on the device: the cast costs nothing there
        if self._pinned is None or self._pinned.numel() < part.numel():
            self._pinned = torch.empty(self.chunk_elements, dtype=torch.int16,
                                       pin_memory=torch.cuda.is_available())
        staged = self._pinned[: part.numel()]
        staged.copy_(part.view(torch.int16))
        return staged

    def _host_diff(self, bits: torch.Tensor, src: torch.Tensor, full: bool,
                   bounds: tuple[int, ...]) -> Diff:
        kernel = _kernel()
        last = bits.numpy()
        found_idx: list[np.ndarray] = []
        found_new: list[np.ndarray] = []
        found_old: list[np.ndarray] = []
        changed = 0
        counts = [0] * (len(bounds) - 1)
        segment = 0
        idx_buf, new_buf, old_buf = self._buffers()
        for start, stop in self._chunks(src.numel(), bounds):
            while start >= bounds[segment + 1]:
                segment += 1
            new = self._host_chunk(src, start, stop).numpy()
            base = last[start:stop]
            if kernel is not None:
                new64, base64 = _words(new, base)
                k = int(kernel(new, base, new64, base64, idx_buf, new_buf, old_buf, start))
                if k and not full:
                    found_idx.append(idx_buf[:k].copy())
                    found_new.append(new_buf[:k].copy())
                    found_old.append(old_buf[:k].copy())
            else:
                where = np.flatnonzero(new != base)
                k = int(where.size)
                if k:
                    values = new[where]
                    if not full:
                        found_idx.append(where + start)
                        found_new.append(values)
                        found_old.append(base[where])
                    base[where] = values
            changed += k
            counts[segment] += k
        if full:
            return Diff(changed, None, bits.view(torch.bfloat16), None, tuple(counts))
        return Diff(changed, torch.from_numpy(_cat(found_idx, np.int64)),
                    torch.from_numpy(_cat(found_new, np.int16)).view(torch.bfloat16),
                    torch.from_numpy(_cat(found_old, np.int16)).view(torch.bfloat16), tuple(counts))


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _shares(names: list[str], sizes: Mapping[str, int], threads: int) -> list[list[str]]:
    """``names`` in ``threads`` shares of about equal elements (largest first, each to the
    lightest share): one task per thread instead of one per tensor, so the many small tensors
    of a small model do not each pay a hand-over to another thread."""
    shares: list[list[str]] = [[] for _ in range(threads)]
    load = [0] * threads
    for name in sorted(names, key=lambda n: -sizes[n]):
        k = load.index(min(load))
        shares[k].append(name)
        load[k] += max(1, sizes[name])
    return shares


def _bounds(cuts: tuple[int, ...], n: int) -> tuple[int, ...]:
    """0, the cuts inside (0, n), n: the segments' edges."""
    return (0, *sorted({c for c in cuts if 0 < c < n}), n)


def _cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    if not parts:
        return np.empty(0, dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


# ---------------------------------------------------------------------- device path
def _device_diff(base: _Baseline, src: torch.Tensor, full: bool, bounds: tuple[int, ...]) -> Diff:
    """Compare, gather and update on the baseline's device; move only the changes to the host."""
    new = src if src.dtype == torch.bfloat16 else src.to(torch.bfloat16)
    new_bits, last = new.view(torch.int16), base.bits
    mask = new_bits != last
    host = torch.device("cpu")
    if len(bounds) > 2:  # one small device-to-host copy of every segment's count
        sums = torch.stack([mask[a:b].sum() for a, b in pairwise(bounds)]).to(host)
        counts = tuple(int(c) for c in sums)
    if full:
        if len(bounds) <= 2:
            counts = (int(mask.sum()),)
        last.copy_(new_bits)
        return Diff(sum(counts), None, last.view(torch.bfloat16).to(host, copy=True), None, counts)
    where = mask.nonzero().view(-1)
    values = new_bits.index_select(0, where)
    old = last.index_select(0, where)
    last.index_copy_(0, where, values)
    if len(bounds) <= 2:
        counts = (int(where.numel()),)
    return Diff(int(where.numel()), where.to(host), values.to(host).view(torch.bfloat16),
                old.to(host).view(torch.bfloat16), counts)


# ---------------------------------------------------------------------- the fused host kernel
def _fused_diff(new, last, new64, last64, idx, new_out, old_out, offset):  # type: ignore[no-untyped-def]
    """Compare ``new`` with ``last`` (int16 bits), write the changed positions (+ ``offset``),
    new and old values to the outputs, and ``last`` := ``new`` there; returns how many.
    ``new64``/``last64`` are the same memory's leading whole int64 words: four elements are
    compared at once and only a word that differs is looked into (at ~1% changed, 4% of them),
    which keeps the pass at about the speed of a copy."""
    k = 0
    for j in range(new64.size):
        if new64[j] != last64[j]:
            for i in range(4 * j, 4 * j + 4):
                v = new[i]
                o = last[i]
                if v != o:
                    idx[k] = i + offset
                    new_out[k] = v
                    old_out[k] = o
                    last[i] = v
                    k += 1
    for i in range(4 * new64.size, new.size):
        v = new[i]
        o = last[i]
        if v != o:
            idx[k] = i + offset
            new_out[k] = v
            old_out[k] = o
            last[i] = v
            k += 1
    return k


def _words(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The leading whole int64 words of two int16 arrays of one size, or none for both where
    either is not 8-byte aligned (a parameter that is a view at an odd element offset): the
    fused pass reads word ``j`` of both, so they must cover the same elements."""
    if a.ctypes.data % 8 or b.ctypes.data % 8:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    n = a.size // 4 * 4
    return a[:n].view(np.int64), b[:n].view(np.int64)


_KERNEL: list[Any] = []
"""The fused diff compiled by numba: empty until the first host diff decides, then [it or None]."""


def _kernel() -> Any:
    """``_fused_diff`` compiled by numba, or None (numba missing or failing: numpy passes)."""
    return once(_KERNEL, lambda: first(compile_kernels(
        (_fused_diff,), _check_kernel, log=log, label="publisher diff", what="the fused diff",
        fallback="diffing with numpy")))


def _check_kernel(jitted: Any) -> None:
    new = np.array([1, 2, 3, 4, 5, 6], np.int16)
    last = np.array([1, 9, 3, 4, 5, 0], np.int16)
    idx, nv, ov = np.empty(6, np.int64), np.empty(6, np.int16), np.empty(6, np.int16)
    k = jitted(new, last, *_words(new, last), idx, nv, ov, 10)
    if (k != 2 or idx[:2].tolist() != [11, 15] or nv[:2].tolist() != [2, 6]
            or ov[:2].tolist() != [9, 0] or last.tolist() != new.tolist()):
        raise RuntimeError("self-check failed")


__all__ = ["CHUNK_ELEMENTS", "Diff", "Differ"]

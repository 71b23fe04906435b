"""Packed CPU kernels: layers whose GEMM computes from a packed copy of their weight.

On the CPU build vLLM packs every 2-D linear weight at load time (a oneDNN handle, an sgl
packed tensor, a zentorch prepacked weight: ``dispatch_cpu_unquantized_gemm``) and then
computes from the copy only, so an in-place write to the parameter changes nothing. Two ways
to follow a bucket there (``SyncConfig.cpu_kernels``):

- ``inplace``: the extension does not pack; the layer computes from its parameter with
  ``torch.nn.functional.linear``, as GPU kernels do. Writes are visible at once; decode is
  slower (the packed kernels are faster on CPU).
- ``packed``: vLLM's own packing is kept, with the parameter kept too (``remove_weight=False``,
  so the shard map writes into it). After a switch has written a step into the parameters,
  the layers it touched are packed again and their kernels swapped (:meth:`PackedLayers.refresh`),
  before the next model step. Same kernels as a stock engine; costs the repacking in the switch
  pause and a second copy of the linear weights in memory.

Off the critical path where it can be (:meth:`PackedLayers.prebuild`): once a delta is staged
and the live weights are at its base step, the poller thread copies each layer it touches,
writes the step's pieces into the copy and packs that, so the switch only writes the
parameters and swaps kernels. The prebuilt kernels are used only if no write of ours happened
since the copies were taken (``Writes.seq`` of ``writes.py``, a sequence counter: odd while a write is
under way), and only for that one step; otherwise the switch packs as above. They hold another
packed copy of the touched layers until the switch, so they are built only when that fits in
``max_staged_bytes``.

The packing itself is vLLM's and lives in ``server/vllm/cpu_gemm.py`` (the vLLM boundary): it puts
a ``_deltasync_repack`` callable on each layer vLLM packed (none where vLLM keeps computing
from the parameter, e.g. bf16 on a CPU without AVX-512), which returns a new kernel for the
layer's current weights without installing it. This module only finds those layers and swaps
kernels, so it imports no vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_deltasync.server.worker.shardmap import Piece

REPACK_ATTR = "_deltasync_repack"
"""Set on a packed layer by the extension's CPU GEMM dispatch: ``(weight=None, bias=None) ->
kernel``, packed from the layer's live tensors, or from the copies given."""
INSTALL_ATTR = "_deltasync_install"
"""Set beside it: ``(kernel) -> None`` makes the layer compute with that kernel."""


@dataclass
class Prebuilt:
    """Kernels packed ahead for one staged step, valid while ``seq`` is the rank's write_seq."""

    step: int
    seq: int
    kernels: list[tuple[torch.nn.Module, Any]]
    nbytes: int
    seconds: float


class PackedLayers:
    """The model's packed layers, by the parameters their kernels were packed from."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers: list[torch.nn.Module] = []
        self.by_param: dict[int, list[torch.nn.Module]] = {}
        for module in model.modules():
            if getattr(module, REPACK_ATTR, None) is None:
                continue
            self.layers.append(module)
            for name in ("weight", "bias"):
                param = getattr(module, name, None)
                if isinstance(param, torch.Tensor):
                    self.by_param.setdefault(id(param), []).append(module)
        self.repacks = 0
        """Layers packed again since start (at the switch or ahead of it)."""
        self.seconds = 0.0
        """Time spent packing them (ahead of a switch included)."""
        self.last: dict[str, Any] = {}
        self.prebuilt_used = 0
        """Switches that installed kernels packed ahead (:meth:`prebuild`)."""
        self.prebuilt_discarded = 0
        """Kernels packed ahead and not used (a write of ours came between)."""

    def __bool__(self) -> bool:
        return bool(self.layers)

    def touched(self, params: Iterable[torch.Tensor]) -> list[torch.nn.Module]:
        """The packed layers computing from any of ``params`` (each once, in model order)."""
        found: dict[int, torch.nn.Module] = {}
        for param in params:
            for module in self.by_param.get(id(param), ()):
                found.setdefault(id(module), module)
        order = {id(m): i for i, m in enumerate(self.layers)}
        return sorted(found.values(), key=lambda m: order[id(m)])

    def refresh(self, params: Iterable[torch.Tensor] | None = None) -> int:
        """Pack again the layers computing from ``params`` (all when None) and swap their
        kernels; return how many. Every new kernel is built before any is swapped, so a
        failure (out of memory) leaves every layer on its old kernel; the caller then puts the
        weights back, which keeps the two consistent."""
        if not self.layers:
            return 0
        layers = list(self.layers) if params is None else self.touched(params)
        started = time.perf_counter()
        built = [(module, getattr(module, REPACK_ATTR)()) for module in layers]
        for module, kernel in built:
            getattr(module, INSTALL_ATTR)(kernel)
        seconds = time.perf_counter() - started
        self.repacks += len(built)
        self.seconds += seconds
        self.last = {"layers": len(built), "seconds": seconds}
        return len(built)

    def prebuild(self, step: int, seq: int, pieces: list[Piece],
                 limit_bytes: int) -> Prebuilt | None:
        """Poller thread: kernels for the layers ``pieces`` touch, packed from copies of their
        current weights with ``pieces`` written in. None when there is nothing to build, the
        copies would exceed ``limit_bytes``, or a piece is dense (anchors: packed at the switch).
        The caller checks that no write happened meanwhile (``seq``)."""
        from vllm_deltasync.server.worker.apply import apply_patches, replace_piece

        if not self.layers or any(p.dense is not None for p in pieces):
            return None
        by_param: dict[int, list[Piece]] = {}
        for piece in pieces:
            by_param.setdefault(id(piece.param), []).append(piece)
        layers = self.touched(p.param for p in pieces)
        nbytes = sum(_nbytes(m) for m in layers)
        if not layers or nbytes > limit_bytes:
            return None
        started = time.perf_counter()
        kernels = []
        for module in layers:
            copies: dict[str, torch.Tensor | None] = {}
            for name in ("weight", "bias"):
                live = getattr(module, name, None)
                if not isinstance(live, torch.Tensor):
                    copies[name] = None
                    continue
                copy = live.detach().clone()
                apply_patches(replace_piece(p, p.indices, p.values, param=copy)
                              for p in by_param.get(id(live), ()))
                copies[name] = copy
            kernels.append((module, getattr(module, REPACK_ATTR)(copies["weight"],
                                                                  copies["bias"])))
        return Prebuilt(step, seq, kernels, nbytes, time.perf_counter() - started)

    def swap(self, prebuilt: Prebuilt, params: Iterable[torch.Tensor]) -> int:
        """Main thread, at the switch: install ``prebuilt``'s kernels, and pack the layers
        ``params`` touch that it lacks (none when it was built from the same step)."""
        started = time.perf_counter()
        done = {id(m) for m, _ in prebuilt.kernels}
        rest = [p for p in params if any(id(m) not in done for m in self.by_param.get(id(p), ()))]
        for module, kernel in prebuilt.kernels:
            getattr(module, INSTALL_ATTR)(kernel)
        n = len(prebuilt.kernels) + (self.refresh(rest) if rest else 0)
        self.repacks += len(prebuilt.kernels)
        self.seconds += prebuilt.seconds
        self.prebuilt_used += 1
        self.last = {"layers": n, "seconds": time.perf_counter() - started,
                     "prebuilt_seconds": prebuilt.seconds}
        return n

    def status(self) -> dict[str, Any]:
        return {"layers": len(self.layers), "repacked": self.repacks,
                "repack_seconds": round(self.seconds, 6), "prebuilt_used": self.prebuilt_used,
                "prebuilt_discarded": self.prebuilt_discarded, "last": dict(self.last)}


def _nbytes(module: torch.nn.Module) -> int:
    weight = getattr(module, "weight", None)
    return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else 0


__all__ = ["REPACK_ATTR", "PackedLayers", "Prebuilt"]

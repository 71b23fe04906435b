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

The packing itself is vLLM's and lives in ``server/extension.py`` (the one vLLM module): it puts
a ``_deltasync_repack`` callable on each packed layer, which returns a new kernel for the
layer's current weights without installing it. This module only finds those layers and swaps
kernels, so it imports no vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

REPACK_ATTR = "_deltasync_repack"
"""Set on a packed layer by the extension's CPU GEMM dispatch: ``() -> kernel``."""


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
        """Layers packed again since start."""
        self.seconds = 0.0
        """Time spent packing them."""
        self.last: dict[str, Any] = {}

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
            module.cpu_linear = kernel
        seconds = time.perf_counter() - started
        self.repacks += len(built)
        self.seconds += seconds
        self.last = {"layers": len(built), "seconds": seconds}
        return len(built)

    def status(self) -> dict[str, Any]:
        return {"layers": len(self.layers), "repacked": self.repacks,
                "repack_seconds": round(self.seconds, 6), "last": dict(self.last)}


__all__ = ["REPACK_ATTR", "PackedLayers"]

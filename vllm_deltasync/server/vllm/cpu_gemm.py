"""The CPU build's Linear dispatch, kept pointing at weights a switch can write in place.

vLLM's CPU build packs each Linear's weight at load time and frees the parameter's storage
(``dispatch_cpu_unquantized_gemm``), so an in-place write would change nothing the kernel
reads. :func:`patch` (installed by the plugin, on the CPU platform only) replaces that
dispatch; for an engine that does not name the extension, or whose deltasync configuration is
invalid, it calls vLLM's own unchanged. ``cpu_kernels="packed"``: vLLM's packed kernel is
built from the kept weight, and rebuilt for the layers a switch wrote
(``server/worker/packed.py``). ``cpu_kernels="inplace"``: no packing; the layer computes from
its parameter through ``torch.nn.functional.linear``, as on GPUs (docs/extension.md).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from vllm_deltasync.config import SyncConfig
from vllm_deltasync.server.vllm.guard import extension_configured


def patch() -> None:
    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_deltasync_patched", False):
        return

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        mode = _active_cpu_kernels()
        if (mode is not None and isinstance(weight, torch.Tensor) and weight.ndim == 2
                and not weight.is_meta):
            if mode == "packed":
                install_packed(original, layer)
            else:
                layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]
            return
        original(layer, remove_weight)

    dispatch_cpu_unquantized_gemm._deltasync_patched = True  # type: ignore[attr-defined]
    dispatch_cpu_unquantized_gemm._deltasync_original = original  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def _active_cpu_kernels() -> str | None:
    """``SyncConfig.cpu_kernels`` of the engine being built, None when it does not run our
    extension or its deltasync config is invalid (the rank refuses at start; stock kernels)."""
    from vllm.config import get_current_vllm_config_or_none

    from vllm_deltasync.errors import ConfigError

    vllm_config = get_current_vllm_config_or_none()
    if not extension_configured(vllm_config):
        return None
    try:
        config = SyncConfig.from_sources(getattr(vllm_config, "additional_config", None),
                                         os.environ)
    except ConfigError:
        return None
    return config.cpu_kernels


class _PackSource:
    """What vLLM's CPU GEMM dispatch reads from a layer, so it packs without touching the
    layer: a weight (the live one, read only: ``remove_weight`` is False; or a staged copy) and
    a private copy of the bias (the sgl path converts the bias it is given to float32 in place)."""

    def __init__(self, layer: torch.nn.Module, weight: torch.Tensor | None,
                 bias: torch.Tensor | None) -> None:
        self.weight = layer.weight if weight is None else weight
        if bias is None:
            bias = getattr(layer, "bias", None)
        self.bias = (torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
                     if isinstance(bias, torch.Tensor) else None)
        self.cpu_linear: Any = None


def install_packed(original: Any, layer: torch.nn.Module) -> None:
    """``cpu_kernels="packed"``: vLLM's own packed kernel for ``layer``, built from its live
    weight, and a ``_deltasync_repack(weight=None, bias=None)`` that builds a new one from the
    current weights, or from given copies (``server/worker/packed.py`` swaps it in after a
    switch wrote the layer, or builds it ahead from the staged step)."""
    from vllm_deltasync.server.worker.packed import INSTALL_ATTR, REPACK_ATTR

    def repack(weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> Any:
        source = _PackSource(layer, weight, bias)
        original(source, False)
        kernel = source.cpu_linear
        live_bias = getattr(layer, "bias", None)
        if source.bias is None or (isinstance(live_bias, torch.Tensor)
                                   and source.bias.dtype == live_bias.dtype):
            return kernel  # the kernel takes the live bias at each call
        packed_bias = source.bias  # the kernel wants its own (float32) copy of the bias

        def linear(x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
            return kernel(x, weight, packed_bias)

        return linear

    kernel = repack()
    layer.cpu_linear = kernel  # type: ignore[assignment]
    if reads_its_weight(kernel, layer.weight):
        # vLLM packed nothing for this layer (bf16 on a CPU without AVX-512: oneDNN makes no
        # bf16 primitive there and vLLM falls back to torch's linear on the weight it is
        # given): the layer computes from its parameter, as in "inplace"; nothing to refresh
        return
    setattr(layer, REPACK_ATTR, repack)
    setattr(layer, INSTALL_ATTR, functools.partial(_install, layer))


def _install(layer: torch.nn.Module, kernel: Any) -> None:
    """The layer computes with ``kernel`` from now on (vLLM's CPU Linear calls
    ``layer.cpu_linear``)."""
    layer.cpu_linear = kernel  # type: ignore[assignment]


def reads_its_weight(kernel: Any, weight: Any) -> bool:
    """Whether ``kernel(x, weight, bias)`` computes from the ``weight`` it is given rather than
    from a packed copy: fed two different weights (all zeros, all ones; stride-0 views, no
    allocation) it matches ``torch.nn.functional.linear`` on both, which a kernel reading a
    copy packed at load cannot. Any doubt (an error) answers False: the layer is then treated
    as packed and refreshed after each write, which is always correct."""
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.is_meta:
        return False
    n, k = weight.shape
    try:
        with torch.no_grad():
            x = torch.ones(1, k, dtype=weight.dtype)
            for fill in (0.0, 1.0):
                probe = torch.full((), fill, dtype=weight.dtype).expand(n, k)
                if not torch.equal(kernel(x, probe, None),
                                   torch.nn.functional.linear(x, probe, None)):
                    return False
    except Exception:  # noqa: BLE001 - see the docstring
        return False
    return True



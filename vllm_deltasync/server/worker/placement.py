"""How the shard-map probe's result becomes the map (``shardmap.py``): the checkpoint names the
loaders placed nowhere (ignored buffers, tied tensors, names another rank's loader declined,
layers of another pipeline stage, or errors), the parameters a kernel rearranged after loading
(probed through a stand-in of the loader's shape), and names that write exactly where another
does."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from vllm_deltasync.errors import ApplyError
from vllm_deltasync.server.worker._shardprobe import DECLINED, Block
from vllm_deltasync.server.worker.layouts import Layout, LayoutSpec

RECOMPUTED_BUFFER_SUFFIXES = (
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)
"""Checkpoint names ending like this are buffers the engine recomputes; ignored if unplaced."""


def layout_of(layouts: Mapping[str, LayoutSpec], param_name: str) -> Layout | None:
    spec = layouts.get(param_name)
    if spec is None:
        return None
    if spec.layout is None:
        raise ApplyError(f"layout of {param_name!r} was not learned before probing")
    return spec.layout


class standins:
    """While probing, parameters with a learned layout are replaced by a stand-in of the loader
    shape (``torch.empty``: never written, so no pages are touched) carrying the parameter's
    attributes (``weight_loader``, ...), so the loaders compute loader-layout offsets."""

    def __init__(self, model: torch.nn.Module, layouts: Mapping[str, LayoutSpec]) -> None:
        self.model = model
        self.layouts = layouts
        self.saved: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []

    def __enter__(self) -> None:
        for pname, spec in self.layouts.items():
            owner_name, _, attr = pname.rpartition(".")
            owner = self.model.get_submodule(owner_name)
            real = owner._parameters.get(attr)
            if real is None:
                raise ApplyError(f"learned layout for {pname!r}, which is not a parameter")
            stand = torch.nn.Parameter(
                torch.empty(spec.loader_shape, dtype=real.dtype, device=real.device),
                requires_grad=False)
            for k, v in vars(real).items():
                setattr(stand, k, v)
            owner._parameters[attr] = stand
            self.saved.append((owner, attr, real))

    def __exit__(self, *exc: object) -> None:
        while self.saved:
            owner, attr, real = self.saved.pop()
            owner._parameters[attr] = real


def classify_unplaced(
    unplaced: Mapping[str, str],
    placed: Mapping[str, list[tuple[str, Block]]],
    params: Mapping[str, torch.Tensor],
    model: torch.nn.Module | None = None,
) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """Split unplaced names into ignored (tied / recomputed / another rank's) and errors."""
    owner: dict[int, str] = {}
    for name, blocks in placed.items():
        for pname, _ in blocks:
            owner.setdefault(id(params[pname]), name)
    ignored: dict[str, str] = {}
    covered: dict[str, str] = {}
    errors: list[str] = []
    for name, why in unplaced.items():
        tied = params.get(name)
        if tied is not None and id(tied) in owner and owner[id(tied)] != name:
            covered[name] = owner[id(tied)]
            ignored[name] = f"tied: covered by {owner[id(tied)]!r}"
        elif name.endswith(RECOMPUTED_BUFFER_SUFFIXES):
            ignored[name] = "buffer recomputed by the engine"
        elif why.startswith(DECLINED):  # e.g. an expert another expert-parallel rank holds
            ignored[name] = f"not on this rank: {why}"
        elif model is not None and (stage := _missing_stage_layer(model, name)) is not None:
            ignored[name] = f"not on this rank: {stage!r} is another pipeline stage's"
        else:
            errors.append(f"{name!r}: {why}")
    return ignored, covered, errors


def _missing_stage_layer(model: torch.nn.Module, name: str) -> str | None:
    """The module on the way to checkpoint tensor ``name`` that is a placeholder for a layer
    another pipeline stage holds (vLLM's ``PPMissingLayer``), or None. Found by the module
    path only: a name that does not resolve in the model is not excused."""
    parts = name.split(".")
    module = model
    for i, part in enumerate(parts[:-1]):
        child = module._modules.get(part)
        if child is None:
            return None
        if type(child).__name__ == "PPMissingLayer":
            return ".".join(parts[: i + 1])
        module = child
    return None


def duplicates(
    placed: Mapping[str, list[tuple[str, Block]]], params: Mapping[str, torch.Tensor]
) -> dict[str, str]:
    """Names whose blocks are exactly another name's (tied weights both loaded): name -> first."""
    seen: dict[tuple[tuple[int, Block], ...], str] = {}
    dups: dict[str, str] = {}
    for name, blocks in placed.items():
        key = tuple((id(params[p]), b) for p, b in blocks)
        if key and key in seen:
            dups[name] = seen[key]
        seen.setdefault(key, name)
    return dups


__all__ = ["RECOMPUTED_BUFFER_SUFFIXES", "classify_unplaced", "duplicates", "layout_of", "standins"]

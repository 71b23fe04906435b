"""vLLM's loading machinery, as the shard-map probe needs it (``server/worker/_shardprobe.py``).

The probe runs a model's own ``load_weights`` on meta-device stand-ins and records where each
checkpoint tensor lands. Two things of vLLM are touched for it, both here: the model's
``load_weights`` and each parameter's ``weight_loader`` (wrapped while probing, to hear a
loader answer ``False``: vLLM's ``return_success`` protocol for "not on this rank").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from vllm_deltasync.errors import ApplyError
from vllm_deltasync.server.worker._shardprobe import Loader, tensors_of


def load_weights(model: torch.nn.Module) -> Callable[[Iterable[tuple[str, torch.Tensor]]], Any]:
    found = getattr(model, "load_weights", None)
    if not callable(found):
        raise ApplyError(f"{type(model).__name__} has no load_weights(); cannot derive a shard map")
    return found


class Declines:
    """While probing, wraps every parameter's ``weight_loader`` attribute to record the ones
    that answer ``False`` (vLLM's ``return_success`` protocol: not loaded here)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.declined: list[tuple[str, tuple[Any, ...]]] = []
        """(parameter, the loader's tensor arguments) of each call that answered False."""
        self.saved: list[tuple[torch.Tensor, bool, Any]] = []

    def __enter__(self) -> Declines:
        for pname, p in self.model.named_parameters(remove_duplicate=False):
            inner = getattr(p, "weight_loader", None)
            if not callable(inner):
                continue
            own = "weight_loader" in vars(p)
            try:
                p.weight_loader = self._wrap(pname, inner)  # type: ignore[attr-defined]
            except AttributeError:  # a read-only property (vLLM's parameter classes)
                continue
            self.saved.append((p, own, inner))
        return self

    def _wrap(self, pname: str, inner: Any) -> Any:
        def weight_loader(*args: Any, **kwargs: Any) -> Any:
            result = inner(*args, **kwargs)
            if result is False:
                self.declined.append((pname, tuple(tensors_of(args, kwargs))))
            return result

        return weight_loader

    def __exit__(self, *exc: object) -> None:
        for p, own, inner in reversed(self.saved):
            # vLLM's parameter classes keep the loader behind a property whose deleter
            # *clears* it: set it back there (deleting would break every later load_weights,
            # reload_weights included); delete only our instance attribute over a class one
            if own or isinstance(getattr(type(p), "weight_loader", None), property):
                p.weight_loader = inner  # type: ignore[attr-defined]
            else:
                delattr(p, "weight_loader")
        self.saved.clear()




LOADER = Loader(load_weights=load_weights, declines=Declines)
"""vLLM's loaders, for ``ShardMap.from_model`` (``WorkerView.loader``)."""

__all__ = ["LOADER", "Declines", "load_weights"]

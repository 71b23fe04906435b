"""LoRA policies: what ``DeltaPublisher.publish(step, model)`` takes from a module.

Two modes (docs/trainer.md, "LoRA"):

- **merged** (:func:`merged_tensors`): the weights ``merge_and_unload()`` would give, under the
  base checkpoint's parameter names (``model.layers.0.self_attn.q_proj.weight``: what vLLM
  loads), bit for bit. Every adapted layer is merged by PEFT's own code on a private copy of
  that layer: the training model's parameters are never written (no merge/unmerge round
  trip), and every variant PEFT merges is merged as PEFT merges it (plain LoRA, rsLoRA, DoRA;
  PiSSA and OLoRA, whose base weights PEFT changed at initialisation, give those changed
  weights plus the adapter). ``modules_to_save`` are published as the ordinary parameters they
  replace. A module without adapters publishes its ``named_parameters()``.
- **adapter** (:func:`adapter_tensors`): only the adapter, under the names PEFT's
  ``save_pretrained`` writes into ``adapter_model.safetensors``, with its configuration as the
  manifest's ``adapter`` record (format/adapter.py).

peft is imported only when a model comes from it (``sys.modules``): the package imports and
publishes plain modules without it.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from vllm_deltasync.errors import PublishError
from vllm_deltasync.format.adapter import AdapterInfo
from vllm_deltasync.format.manifest import fingerprint

MODES = ("merged", "adapter")
"""What a publisher takes from a PEFT model: the merged weights (default) or the adapter."""
BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
"""``init_lora_weights`` values (or prefixes) with which PEFT changes the base weights at
initialisation: such an adapter does not apply onto the base checkpoint."""


def published_tensors(step: int, source: Any, mode: str
                      ) -> tuple[list[tuple[str, torch.Tensor]], AdapterInfo | None]:
    """What ``DeltaPublisher.publish(step, source)`` publishes in ``mode`` (:data:`MODES`):
    a module's merged weights (:func:`merged_tensors`) or adapter (:func:`adapter_tensors`,
    with its record), or the given ``(name, tensor)`` pairs / mapping as they are."""
    if isinstance(source, torch.nn.Module):
        if _is_peft_sharded(source):
            raise PublishError(f"step {step}: the PEFT model's parameters are DTensors (a sharded "
                               "trainer); publishing a sharded PEFT model is not supported yet: "
                               "publish the merged weights' named tensors yourself")
        if mode == "adapter":
            tensors, info = adapter_tensors(source)
            return list(tensors.items()), info
        return list(merged_tensors(source)), None
    if mode == "adapter":
        raise PublishError(f"step {step}: lora='adapter' publishes a PEFT model's adapter: pass "
                           "the model, publish(step, peft_model), not its tensors")
    return list(source.items() if isinstance(source, Mapping) else source), None


def _is_peft_sharded(model: torch.nn.Module) -> bool:
    if not is_peft_model(model):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def is_peft_model(model: object) -> bool:
    """A ``peft.PeftModel`` (peft is not imported when no loaded module came from it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def merged_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the weights ``copy.deepcopy(model).merge_and_unload()`` would
    hold, in its ``named_parameters()`` order and names, bit for bit; the model itself is not
    changed. A module that holds no PEFT layer yields its ``named_parameters()``.

    Each adapted layer is copied (its base weight cloned, the adapter's tensors shared) and
    merged by PEFT, one layer at a time: the merged tensors are new, the others are the
    model's own (detached)."""
    with torch.no_grad():
        for name, tensor in _unique(_root(model), merge=True):
            yield name, tensor.detach()


def base_parameters(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of :func:`merged_tensors` without merging anything (the base
    checkpoint's parameter set)."""
    return [(name, tuple(t.shape)) for name, t in _unique(_root(model), merge=False)]


def _unique(root: torch.nn.Module, *, merge: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`_walk`, a tensor of the model listed once, under its first name, as
    ``named_parameters()`` lists tied parameters (a merged copy stands for its original)."""
    own = {id(t) for t in _tensors(root)}  # live objects: a fresh tensor never has their id
    seen: set[int] = set()
    for name, tensor, origin in _walk(root, "", merge=merge):
        if origin in own:
            if origin in seen:
                continue
            seen.add(origin)
        yield name, tensor


def _root(model: Any) -> torch.nn.Module:
    """The model PEFT wraps (a PeftModel's ``base_model.model``), or ``model``."""
    if not is_peft_model(model):
        return getattr(model, "model", model) if _is_tuner_model(model) else model
    config = model.peft_config[model.active_adapter]
    if config.is_prompt_learning:
        raise PublishError(f"a {config.peft_type} model holds no weights to merge (prompt learning); "
                           "publish the model it wraps (model.base_model)")
    return model.base_model.model  # type: ignore[no-any-return]


def _is_tuner_model(model: torch.nn.Module) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.tuners.tuners_utils.BaseTuner)


def _walk(module: torch.nn.Module, prefix: str, *,
          merge: bool) -> Iterator[tuple[str, torch.Tensor, int]]:
    """``(name, tensor, id of the model's tensor it stands for)`` of ``named_parameters(
    remove_duplicate=False)`` of ``module`` once PEFT has unloaded (and, with ``merge``,
    merged) every adapter layer in it, as ``_unload_and_optionally_merge`` walks it."""
    for name, param in module.named_parameters(recurse=False):
        yield prefix + name, param, id(param)
    for name, child in module.named_children():
        if _is_peft_wrapper(child):
            unloaded, origin = _unloaded(child, merge=merge)
            for sub, param in unloaded.named_parameters(remove_duplicate=False):
                yield f"{prefix}{name}.{sub}", param, origin.get(id(param), id(param))
        else:
            yield from _walk(child, f"{prefix}{name}.", merge=merge)


def _is_peft_wrapper(module: torch.nn.Module) -> bool:
    """What PEFT's unload replaces by the module it wraps (an adapter layer, modules_to_save,
    trainable tokens); never a module of a model PEFT did not touch (peft not even loaded)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, (peft.tuners.tuners_utils.BaseTunerLayer,
                                                    peft.utils.other.AuxiliaryTrainingWrapper))


def _unloaded(wrapper: Any, *, merge: bool) -> tuple[torch.nn.Module, dict[int, int]]:
    """The module PEFT's unload puts in ``wrapper``'s place, and ``id(copy) -> id(original)``
    of the tensors it copied: without ``merge`` read from the wrapper (nothing is written),
    with ``merge`` from a private copy PEFT merges."""
    target: Any
    target, origin = _private_copy(wrapper) if merge else (wrapper, {})
    if hasattr(target, "unload_and_optionally_merge_module"):
        return target.unload_and_optionally_merge_module(
            merge=merge, safe_merge=False, adapter_names=None), origin
    if merge:
        target.merge(safe_merge=False, adapter_names=None)
    return target.get_base_layer(), origin


def _private_copy(wrapper: Any) -> tuple[torch.nn.Module, dict[int, int]]:
    """A deep copy of ``wrapper`` whose base layers (what a merge writes) have their own
    tensors, and ``id(copy) -> id(original)`` of those; every other tensor (the adapter's,
    modules_to_save) is shared, not copied."""
    written = {id(t): t for m in wrapper.modules() if _is_adapter_layer(m)
               for t in _tensors(m.get_base_layer())}  # type: ignore[operator]
    memo: dict[int, Any] = {id(t): t for t in _tensors(wrapper) if id(t) not in written}
    copied = copy.deepcopy(wrapper, memo)
    return copied, {id(memo[key]): key for key in written if key in memo}


def _is_adapter_layer(module: torch.nn.Module) -> bool:
    """A PEFT layer whose merge writes its base layer's tensors."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.tuners.tuners_utils.BaseTunerLayer)


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


# ---------------------------------------------------------------------------- adapter mode
def adapter_name(model: Any) -> str:
    """The one active adapter of a PeftModel (PublishError when it is no PeftModel, or when
    several adapters are active: publish one per bucket)."""
    if not is_peft_model(model):
        raise PublishError(f"lora='adapter' publishes the adapter of a peft.PeftModel; got a "
                           f"{type(model).__name__}. Publish it with lora='merged' (or its "
                           "named_parameters()), or wrap it with peft.get_peft_model")
    active = model.active_adapters
    if len(active) != 1:
        raise PublishError(f"lora='adapter': {len(active)} adapters are active ({active}); a "
                           "bucket holds one adapter: model.set_adapter(name) before publishing")
    return str(active[0])


def adapter_tensors(model: Any) -> tuple[dict[str, torch.Tensor], AdapterInfo]:
    """The active adapter's tensors as ``save_pretrained`` names them in
    ``adapter_model.safetensors``, and its manifest record (configuration as
    ``adapter_config.json`` holds it, base fingerprint). PublishError for an adapter that
    does not apply onto the base checkpoint (PiSSA, OLoRA, ...: publish those merged)."""
    from peft import get_peft_model_state_dict

    name = adapter_name(model)
    config = model.peft_config[name]
    if config.peft_type != "LORA":
        raise PublishError(f"lora='adapter' publishes LoRA adapters; adapter {name!r} is "
                           f"{config.peft_type}: publish it merged (lora='merged')")
    init = config.init_lora_weights
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise PublishError(f"adapter {name!r} was initialised with init_lora_weights={init!r}, "
                           "which changes the base weights: the adapter does not apply onto the "
                           "base checkpoint. Publish it merged (lora='merged', the default)")
    with torch.no_grad():
        state = get_peft_model_state_dict(model, adapter_name=name)
    tensors = {k: v.detach() for k, v in state.items()}
    base = fingerprint((n, shape, "bfloat16") for n, shape in base_parameters(model))
    return tensors, AdapterInfo.from_config(_saved_config(model, config), base)


def _saved_config(model: Any, config: Any) -> dict[str, Any]:
    """``adapter_config.json`` as ``save_pretrained`` writes it (sets as sorted lists)."""
    config = copy.deepcopy(config)
    inner = model.base_model.model
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = inner.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    out = config.to_dict()
    for key, value in out.items():
        if isinstance(value, set):
            out[key] = sorted(value)
    if config.task_type is None:
        cls = type(inner)
        out["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    try:  # plain JSON values (PEFT's enums are strings), as a reader parses them back
        return dict(json.loads(json.dumps(out)))
    except (TypeError, ValueError) as exc:
        raise PublishError(f"lora='adapter': the configuration of the adapter does not serialize "
                           f"as adapter_config.json ({exc})") from exc


__all__ = ["MODES", "adapter_name", "adapter_tensors", "base_parameters", "is_peft_model",
           "merged_tensors", "published_tensors"]

"""Worker side of the vLLM boundary for LoRA adapters: vLLM's LoRA manager of one worker, as a
followed adapter's versions use it (``server/worker/adapters.py`` ``AdapterSlots``).

A version is handed to vLLM from memory, the way vLLM's own ``WorkerLoRAManager._load_adapter``
loads one from a directory, minus the directory: ``PEFTHelper.from_dict`` on the adapter's
``adapter_config.json`` object (with the model's ``max_position_embeddings``, as
``from_local_dir`` adds it), ``validate_legal`` against the server's LoRA config, the
unexpected-module check of ``from_local_checkpoint``, ``LoRAModel.from_lora_tensors`` on the
host in the LoRA dtype (with the model's weights mapper and skipped prefixes), the manager's
format checks, then ``add_adapter`` and a pin in the CPU cache only (a pin in the GPU cache
would hold one of the ``--max-loras`` slots for good; vLLM moves a version into a slot when a
batch uses it). The adapter's tensors are cloned first: vLLM scales ``lora_b`` in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vllm_deltasync.errors import ApplyError


class LoraSlots:
    """``AdapterSlots`` on vLLM's ``LRUCacheWorkerLoRAManager`` (module doc)."""

    def __init__(self, manager: Any) -> None:
        self._worker = manager
        self._manager = manager._adapter_manager
        config = manager.lora_config
        self._config = config
        self.max_rank = int(config.max_lora_rank)
        self.capacity = int(config.max_cpu_loras)
        model = self._manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        self._mapper = mapper.get_rename_mapper() if mapper is not None else None
        self._skip = getattr(model, "lora_skip_prefixes", None)

    def modules(self) -> frozenset[str]:
        """The names ``_load_adapter`` expects (packed modules expanded)."""
        packed = self._manager.packed_modules_mapping
        out: set[str] = set()
        for module in self._manager.supported_lora_modules:
            out.update(packed.get(module, [module]))
            if module == "experts":
                out.add(module)
        return frozenset(out)

    def _helper(self, config: Mapping[str, Any]) -> Any:
        from vllm.lora.peft_helper import PEFTHelper

        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings":
                                       self._worker.max_position_embeddings})
        helper.validate_legal(self._config)
        return helper

    def check(self, config: Mapping[str, Any]) -> str | None:
        try:
            self._helper(config)
        except (ValueError, TypeError) as exc:
            return str(exc)
        return None

    def add(self, adapter: int, tensors: Mapping[str, torch.Tensor],
            config: Mapping[str, Any]) -> None:
        from vllm.lora.lora_model import LoRAModel

        helper = self._helper(config)
        self._check_modules(tensors, helper)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=adapter, tensors={k: v.clone() for k, v in tensors.items()},
            peft_helper=helper, device="cpu", dtype=self._config.lora_dtype,
            model_vocab_size=self._worker.vocab_size, weights_mapper=self._mapper,
            skip_prefixes=self._skip)
        self._manager._validate_moe_lora_format(lora)
        self._manager._validate_modules_to_save(lora)
        self._manager._validate_token_classification_lora(lora)
        if len(self._manager) >= self.capacity:
            raise ApplyError(f"vLLM's adapter cache is full ({len(self._manager)} of "
                             f"--max-cpu-loras {self.capacity}); start vLLM with a larger "
                             "--max-cpu-loras")
        self._manager.add_adapter(lora)
        try:
            self._manager._pin_lora_in_cpu_cache(adapter)
        except BaseException:
            self._manager.remove_adapter(adapter)
            raise

    def _check_modules(self, tensors: Mapping[str, torch.Tensor], helper: Any) -> None:
        """``from_local_checkpoint``'s check: every tensor adapts a module vLLM has a LoRA
        layer for (``from_lora_tensors`` does not check)."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

        expected = self.modules()
        unexpected = []
        for name in tensors:
            if is_base_embedding_weights(name) or "base_layer" in name:
                continue
            if self._skip and LoRAModel._should_skip_module(name, self._skip):
                continue
            module, _ = parse_fine_tuned_lora_name(name, self._mapper)
            if ".experts" in module:
                if module[module.find(".experts") + 1:] not in expected:
                    unexpected.append(module)
            elif (module.rsplit(".", 1)[-1] not in expected
                  and module.rsplit(".", 1)[-1] not in (helper.modules_to_save or ())):
                unexpected.append(module)
        if unexpected:
            raise ApplyError(f"expected target modules in {sorted(expected)} but received "
                             f"{sorted(unexpected)[:5]}")

    def remove(self, adapter: int) -> bool:
        return bool(self._manager.remove_adapter(adapter))

    def ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self._manager.list_adapters())


def lora_slots(worker: Any) -> LoraSlots | None:
    """The LoRA manager of this worker's model runner, None without ``--enable-lora``."""
    manager = getattr(worker.model_runner, "lora_manager", None)
    if manager is None or getattr(worker.vllm_config, "lora_config", None) is None:
        return None
    return LoraSlots(manager)


__all__ = ["LoraSlots", "lora_slots"]

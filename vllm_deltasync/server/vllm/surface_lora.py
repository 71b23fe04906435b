"""The vLLM surface of the LoRA adapters followed from buckets (rows of ``surface.py``'s
``SURFACE``, scope ``lora``: a vLLM lacking one refuses the adapters only; the base model and
the drafter follow). Worker side: ``lora.py`` (a version handed to vLLM's LoRA manager from
memory); engine core: ``engine.py`` (versions in use, requests of retired versions failed when
added); API server: ``http.py`` (``<name>`` and ``<name>@<step>`` resolved)."""

from __future__ import annotations

from vllm_deltasync.server.targets import LORA_SCOPE
from vllm_deltasync.server.vllm.symbols import Symbol

_LORA = LORA_SCOPE
_LM = "vllm.lora.model_manager"
_WLM = "vllm.lora.worker_manager:WorkerLoRAManager"
_CORE = "vllm.v1.engine.core"

LORA_SURFACE: tuple[Symbol, ...] = (
    Symbol("vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin.lora_manager", "read",
           "the worker's LoRA manager (--enable-lora), where a version is registered",
           "adapters refuse", attr=True, scope=_LORA),
    Symbol("vllm.config.vllm:VllmConfig.lora_config", "read", "LoRA enabled at all",
           "adapters refuse", attr=True, scope=_LORA),
    Symbol(f"{_WLM}._adapter_manager", "read", "the manager of registered adapters",
           "adapters refuse", attr=True, private=True, scope=_LORA),
    Symbol(f"{_WLM}.lora_config", "read", "max rank, CPU slots, LoRA dtype",
           "adapters refuse", attr=True, scope=_LORA),
    Symbol(f"{_WLM}.vocab_size", "read", "from_lora_tensors' model_vocab_size (as vLLM's own "
           "_load_adapter)", "adapters refuse", attr=True, scope=_LORA),
    Symbol(f"{_WLM}.max_position_embeddings", "read",
           "PEFTHelper's vllm_max_position_embeddings (as from_local_dir adds it)",
           "adapters refuse", attr=True, scope=_LORA),
    Symbol("vllm.config.lora:LoRAConfig.max_lora_rank", "read",
           "refuse an adapter of a higher rank, naming the option", "adapters refuse",
           scope=_LORA),
    Symbol("vllm.config.lora:LoRAConfig.max_cpu_loras", "read",
           "refuse when versions kept x adapters do not fit", "adapters refuse", scope=_LORA),
    Symbol("vllm.config.lora:LoRAConfig.lora_dtype", "read", "the dtype of a version's tensors",
           "adapters refuse", scope=_LORA),
    Symbol(f"{_LM}:LoRAModelManager.model", "read", "the model's weights mapper and skipped "
           "prefixes", "adapters refuse", attr=True, scope=_LORA),
    Symbol(f"{_LM}:LoRAModelManager.supported_lora_modules", "read",
           "the modules an adapter may target (refusal naming the others)", "adapters refuse",
           attr=True, scope=_LORA),
    Symbol(f"{_LM}:LoRAModelManager.packed_modules_mapping", "read", "the same (q/k/v packed)",
           "adapters refuse", attr=True, scope=_LORA),
    Symbol(f"{_LM}:LoRAModelManager._validate_moe_lora_format", "called",
           "vLLM's own check of a version, as _load_adapter runs it", "adapters refuse",
           params=("lora_model",), private=True, scope=_LORA),
    Symbol(f"{_LM}:LoRAModelManager._validate_modules_to_save", "called", "the same",
           "adapters refuse", params=("lora_model",), private=True, scope=_LORA),
    Symbol(f"{_LM}:LoRAModelManager._validate_token_classification_lora", "called", "the same",
           "adapters refuse", params=("lora_model",), private=True, scope=_LORA),
    Symbol(f"{_LM}:LoRAModelManager.__len__", "called", "never evict: refuse a full cache",
           "adapters refuse", scope=_LORA),
    Symbol(f"{_LM}:LRUCacheLoRAModelManager.add_adapter", "called", "register a version",
           "adapters refuse", params=("lora",), scope=_LORA),
    Symbol(f"{_LM}:LRUCacheLoRAModelManager._pin_lora_in_cpu_cache", "called",
           "a version stays registered until we retire it (the CPU cache only: a GPU pin "
           "would hold a --max-loras slot)", "adapters refuse", params=("lora_id",),
           private=True, scope=_LORA),
    Symbol(f"{_LM}:LoRAModelManager.remove_adapter", "called",
           "retire a version, take back a switch", "adapters refuse", params=("adapter_id",),
           scope=_LORA),
    Symbol(f"{_LM}:LoRAModelManager.list_adapters", "called",
           "the ids registered (vLLM dropping ours: reload_weights)", "adapters refuse",
           scope=_LORA),
    Symbol("vllm.lora.peft_helper:PEFTHelper.from_dict", "called",
           "the adapter's adapter_config.json object, from the manifest's adapter record",
           "adapters refuse", params=("config_dict",), scope=_LORA),
    Symbol("vllm.lora.peft_helper:PEFTHelper.validate_legal", "called",
           "vLLM's own checks (rank, DoRA, bias, ...)", "adapters refuse",
           params=("lora_config",), scope=_LORA),
    Symbol("vllm.lora.peft_helper:PEFTHelper.modules_to_save", "read",
           "the unexpected-module check", "adapters refuse", scope=_LORA),
    Symbol("vllm.lora.lora_model:LoRAModel.from_lora_tensors", "called",
           "a version built from memory (no disk round trip)", "adapters refuse",
           params=("lora_model_id", "tensors", "peft_helper", "device", "dtype",
                   "model_vocab_size", "weights_mapper", "skip_prefixes"), scope=_LORA),
    Symbol("vllm.lora.lora_model:LoRAModel._should_skip_module", "called",
           "the unexpected-module check of from_local_checkpoint", "adapters refuse",
           params=("module_name", "skip_prefixes"), private=True, scope=_LORA),
    Symbol("vllm.lora.utils:parse_fine_tuned_lora_name", "called", "the same",
           "adapters refuse", params=("name", "weights_mapper"), scope=_LORA),
    Symbol("vllm.lora.utils:is_base_embedding_weights", "called", "the same",
           "adapters refuse", params=("name",), scope=_LORA),
    Symbol("vllm.model_executor.models.utils:WeightsMapper.get_rename_mapper", "called",
           "a model's hf_to_vllm_mapper renames (as _load_adapter); models without one have "
           "neither attribute", "adapters refuse", scope=_LORA,
           also=("hf_to_vllm_mapper", "lora_skip_prefixes")),
    # engine core: requests of retired versions failed when added, versions in use
    Symbol("vllm.v1.request:Request.lora_request", "read",
           "the same; a request for a version this engine does not keep is failed when added",
           "the same", attr=True, scope=_LORA),
    Symbol("vllm.v1.request:Request.client_index", "read", "where its error output goes",
           "the same", attr=True, scope=_LORA),
    Symbol("vllm.lora.request:LoRARequest.lora_int_id", "read", "the version's adapter id",
           "the same", scope=_LORA),
    Symbol(f"{_CORE}:EngineCoreProc._send_error_outputs_to_client", "called",
           "fail a request for a retired version when it is added (never let a worker try to "
           "load its marker path)", "the same", params=("req_ids", "client_index"),
           private=True, scope=_LORA),
    # API server: resolution of <name> and <name>@<step> (server/vllm/http.py)
    Symbol("vllm.entrypoints.openai.models.serving:OpenAIServingModels.lora_requests", "read",
           "register <name> and each kept <name>@<step> (what vLLM resolves a request's model "
           "with, and /v1/models lists); found on the app state as openai_serving_models",
           "requests naming an adapter get vLLM's 404", attr=True, scope=_LORA,
           also=("openai_serving_models",)),
    Symbol("vllm.lora.request:LoRARequest", "called",
           "the exact version a request is served by (lora_name <name>@<step>, its id, a "
           "marker path; its fields are the rows below)", "the same", scope=_LORA),
    Symbol("vllm.lora.request:LoRARequest.lora_name", "read", "which entry a request named",
           "the same", scope=_LORA),
    Symbol("vllm.lora.request:LoRARequest.lora_path", "read", "our marker", "the same",
           scope=_LORA),
    Symbol("vllm.v1.engine.core_client:AsyncMPClient.call_utility_all_async", "called",
           "every engine's versions (data parallel: each follows by itself)", "the same",
           params=("method",), private=True, scope=_LORA),
    Symbol("vllm.outputs:CompletionOutput.finish_reason", "read",
           "an engine failed an adapter request when it was added (its version retired): 404",
           "a 500 instead", attr=True, scope=_LORA),
    Symbol("vllm.outputs:CompletionOutput.token_ids", "read", "the same", "the same",
           attr=True, scope=_LORA),
    Symbol("vllm.exceptions:VLLMNotFoundError", "called",
           "a version not kept: vLLM's own 404", "the same", scope=_LORA),
)


__all__ = ["LORA_SURFACE"]

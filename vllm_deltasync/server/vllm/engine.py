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
- both: ``shutdown`` stops the coordinator first, ``deltasync_engine_status`` answers
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
import dataclasses
import importlib
import logging
import os
from collections.abc import Mapping
from typing import Any

from vllm_deltasync.config import ADDITIONAL_CONFIG_KEY, ENV_PREFIX, SyncConfig, is_configured
from vllm_deltasync.errors import DeltaSyncError
from vllm_deltasync.failpoints import ENGINE_HOOK_ENV
from vllm_deltasync.server.engine.coordinator import Coordinator
from vllm_deltasync.server.vllm import surface

logger = logging.getLogger(__name__)

TICK = "deltasync-tick"
"""The payload of the private ``WAKEUP`` the timer sends (handled by our hook, never vLLM)."""



class EngineHandle:
    """What the coordinator calls on an engine core: vLLM's own ``collective_rpc``,
    ``reset_prefix_cache``, ``get_weight_version``, ``set_weight_version`` (bound from the class,
    so our instance hooks are bypassed) and its ``scheduler``."""

    _METHODS = frozenset({"collective_rpc", "reset_prefix_cache", "get_weight_version",
                          "set_weight_version"})

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    @property
    def scheduler(self) -> Any:
        return self._engine.scheduler

    def __getattr__(self, name: str) -> Any:
        if name in EngineHandle._METHODS:
            return getattr(type(self._engine), name).__get__(self._engine)
        raise AttributeError(name)


def on_engine_core(engine: Any) -> None:
    """After ``EngineCore.__init__``: hook this engine core if it names the extension."""
    from vllm.v1.engine.core import EngineCoreProc

    from vllm_deltasync.server.vllm.plugin import extension_configured

    if getattr(engine, "_deltasync_hooked", False) or not extension_configured(
            getattr(engine, "vllm_config", None)):
        return
    engine._deltasync_hooked = True
    engine._deltasync_coord = None
    engine.deltasync_engine_status = lambda: _engine_status(engine)
    engine.deltasync_count_conflict = lambda reason: _count_conflict(engine, reason)
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
    if refused is None and weight_transfer_backend(engine.vllm_config) == BACKEND:
        _hook_weight_transfer(engine)


def _engine_status(engine: Any) -> dict[str, Any]:
    coord = getattr(engine, "_deltasync_coord", None)
    return coord.engine_status() if coord is not None else {"active": False}


def _count_conflict(engine: Any, reason: str) -> None:
    """The API server answered a request 409 (``server/vllm/http.py``): count it on this
    engine's ``/metrics``."""
    coord = getattr(engine, "_deltasync_coord", None)
    if coord is not None:
        coord.metrics.count_conflict(str(reason))


def _ensure_coordinator(engine: Any, *, in_process: bool) -> Any:
    if getattr(engine, "_deltasync_coord", None) is None:
        engine._deltasync_coord = start_coordinator(engine, in_process=in_process)
        _test_hook(engine, engine._deltasync_coord)
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


def _test_hook(engine: Any, coord: Any) -> None:
    spec = os.environ.get(ENGINE_HOOK_ENV)
    if not spec or coord is None:
        return
    module, _, name = spec.partition(":")
    getattr(importlib.import_module(module), name)(engine, coord)


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


def unsupported_layout(vllm_config: Any) -> str | None:
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


def engine_config(config: SyncConfig, vllm_config: Any) -> SyncConfig:
    """The settings of this engine core: under data parallel every engine core serves its own
    metrics endpoint, on ``metrics_port + data-parallel rank`` (rank 0 on ``metrics_port``)."""
    index = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
    if not config.metrics_port or not index:
        return config
    return dataclasses.replace(config, metrics_port=config.metrics_port + index)


def start_coordinator(engine: Any, *, in_process: bool = False) -> Any:
    """The coordinator of this engine core, started (``Coordinator.start``): it refuses,
    with the reason on ``/synced``, when the engine layout cannot switch safely, the deltasync
    configuration is invalid, or this vLLM lacks a symbol of :data:`.surface.SURFACE` (or the
    plugin could not install a patch in this process); vLLM serves the loaded weights then.
    None when deltasync is not configured at all."""
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.engine import EngineCoreRequestType

    refuse = (surface_refusal() or unsupported_layout(engine.vllm_config)
              or weight_transfer_conflict(engine.vllm_config))
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
        config = refusal_config(additional, os.environ)
    if refuse is not None and not refuse.startswith("invalid deltasync"):
        logger.error("deltasync refuses to follow: %s", refuse)
    config = engine_config(config, engine.vllm_config)

    def wake() -> None:
        engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, TICK))

    coord = Coordinator(EngineHandle(engine), config, wake=None if in_process else wake,
                        pause_states=PauseState,
                        trainer_driven=weight_transfer_backend(engine.vllm_config) == BACKEND)
    coord.start(refuse=refuse)
    return coord


def refusal_config(additional_config: Any, environ: Mapping[str, str]) -> SyncConfig:
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




# -------------------------------------------- vLLM's weight-transfer API, backend "deltasync"

BACKEND = "deltasync"
"""The weight-transfer backend name (``--weight-transfer-config '{"backend": "deltasync"}'``);
the receiver is :mod:`.weight_transfer`, registered by :mod:`.plugin`."""


def weight_transfer_backend(vllm_config: Any) -> str | None:
    """The backend of ``--weight-transfer-config``, None when there is none."""
    transfer = getattr(vllm_config, "weight_transfer_config", None)
    backend = getattr(transfer, "backend", None) if transfer is not None else None
    return str(backend) if backend else None


def weight_transfer_conflict(vllm_config: Any) -> str | None:
    """Why a deltasync bucket cannot be followed together with this engine's weight-transfer
    backend (one line), or None. Backend ``deltasync`` is the trainer-driven flow (the
    coordinator switches only on ``update_weights``); any other backend writes the weights by
    its own transport, behind the coordinator's back, so the extension refuses at start."""
    backend = weight_transfer_backend(vllm_config)
    if backend is None or backend == BACKEND:
        return None
    return (f"--weight-transfer-config backend {backend!r} and a deltasync bucket URL "
            "(VLLM_DELTASYNC_URL or additional_config deltasync.url) are both configured: "
            "two writers of the same weights would fight, so deltasync does not follow. Use "
            "--weight-transfer-config '{\"backend\": \"deltasync\"}' for trainer-driven "
            f"updates through the bucket, or remove the bucket URL to update through {backend!r}")


def update_info_step(update_info: Any) -> tuple[Any, Any]:
    """(step, identity) of a ``deltasync`` update (``{"step": N, "identity": ...}``, or a list
    of them, one per worker, all the same); :class:`ValueError` naming what is wrong."""
    infos = update_info if isinstance(update_info, list) else [update_info]
    if not infos or any(not isinstance(i, Mapping) for i in infos):
        raise ValueError(f"deltasync update_info must be {{'step': N, 'identity': ...}}, got "
                         f"{update_info!r}")
    pairs = set()
    for info in infos:
        unknown = set(info) - {"step", "identity"}
        if unknown or "step" not in info:
            raise ValueError(f"deltasync update_info takes 'step' (required) and 'identity', got "
                             f"keys {sorted(info)}")
        pairs.add((info["step"], info.get("identity")))
    if len(pairs) != 1:
        raise ValueError(f"deltasync update_info differs between workers: {sorted(pairs, key=str)}")
    return next(iter(pairs))


def same_bucket(a: str, b: str) -> bool:
    """Two URLs name the same bucket: equal without credentials, a trailing ``/`` and the
    scheme's case."""
    from vllm_deltasync._urls import strip_userinfo

    def normal(url: str) -> str:
        scheme, sep, rest = strip_userinfo(str(url).strip()).partition("://")
        return (scheme.lower() + sep + rest).rstrip("/")

    return normal(a) == normal(b)


def _hook_weight_transfer(engine: Any) -> None:
    """Weight-transfer calls of backend ``deltasync`` are answered in the engine core, by its
    coordinator: ``collective_rpc("update_weights", kwargs={"update_info": {"step": N, ...}})``
    (vLLM's ``LLM.update_weights``, ``AsyncLLM.update_weights``, the dev-mode
    ``/update_weights`` route) goes to :meth:`Coordinator.update_to` and never reaches the
    workers; ``init_weight_transfer_engine`` is checked here first (the trainer's bucket, a
    coordinator that refused) and then goes on to the workers. Errors are raised here, not in
    the workers: vLLM's multiprocessing executor stops reading the ranks' answers at the first
    failure, and the later ranks' answers would be read by the next call. Every other call
    goes on as before. On the instance: vLLM's utility handler looks the method up with
    ``getattr(engine, "collective_rpc")``."""
    rpc = engine.collective_rpc

    def collective_rpc(method: Any, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> Any:
        if method not in ("update_weights", "init_weight_transfer_engine"):
            return rpc(method, timeout, args, kwargs)
        coord = getattr(engine, "_deltasync_coord", None)
        if method == "init_weight_transfer_engine":
            _check_init(coord, (kwargs or {}).get("init_info", args[0] if args else None))
            return rpc(method, timeout, args, kwargs)
        if coord is None:
            raise RuntimeError(
                "update_weights: weight-transfer backend 'deltasync' needs a deltasync bucket "
                "(VLLM_DELTASYNC_URL or --additional-config '{\"deltasync\": {\"url\": ...}}'); "
                "none is configured on this server")
        info = (kwargs or {}).get("update_info", args[0] if args else None)
        step, identity = update_info_step(info)
        coord.update_to(step, identity)
        return [None] * max(1, len(coord.statuses))

    engine.collective_rpc = collective_rpc


def _check_init(coord: Any, init_info: Any) -> None:
    """``init_weight_transfer_engine`` of backend ``deltasync``, in the engine core: a
    coordinator that refused says why; a trainer's bucket other than this server's is an
    error. No coordinator (no bucket configured): the workers' receiver says what is missing."""
    if coord is None:
        return
    if not coord.active:
        raise RuntimeError("init_weight_transfer_engine: weight-transfer backend 'deltasync': "
                           f"deltasync does not follow on this server: {coord.last_error}")
    url = init_info.get("url") if isinstance(init_info, Mapping) else None
    if url is not None and not same_bucket(str(url), coord.config.url):
        from vllm_deltasync._urls import redact_url

        raise ValueError(
            f"init_weight_transfer_engine: weight-transfer backend 'deltasync': the trainer "
            f"publishes to {redact_url(str(url))} but this server follows "
            f"{coord.config.redacted_url()} (VLLM_DELTASYNC_URL / additional_config "
            "deltasync.url); give both the same bucket")


def surface_refusal() -> str | None:
    """Why this process's vLLM cannot be followed on (a patch the plugin left out, or a
    symbol of :data:`.surface.SURFACE` missing or changed), one line; None when it can."""
    from vllm_deltasync.server.vllm.plugin import PLUGIN_REFUSALS

    lines = list(PLUGIN_REFUSALS)
    found = surface.cached_problems()
    if found:
        lines.append(f"vLLM {surface.vllm_version()} lacks what vllm-deltasync relies on "
                     f"({'; '.join(found)}); vLLM serves the loaded weights, the extension "
                     "does not follow. Install a vLLM version this release supports "
                     "(docs/extension.md, compatibility table)")
    return " ".join(lines) or None

"""vLLM glue: the worker extension, the engine-core coordinator, the CPU-build patch, the plugin.

This is the only module that imports vLLM, always inside functions.

How it starts by itself
-----------------------
vLLM never calls a worker extension's ``__init__`` and nothing calls its methods unless someone
sends ``collective_rpc``. The way in is the ``vllm.general_plugins`` entry point
(``deltasync = vllm_deltasync.extension:register_plugin``), which vLLM runs in *every* process
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
2. It replaces ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` so that on the
   CPU build, when our extension is configured (read from the current vLLM config at load
   time), 2-D linear weights are not prepacked: the parameter keeps its storage and is used
   through ``torch.nn.functional.linear``. In-place writes then change what the model
   computes, as on GPUs. Cost: 7-20% CPU throughput (docs/extension.md).

Why every rank switches before the same batch: ``collective_rpc`` from the engine core goes
through the same broadcast queue as ``execute_model``, and every worker runs them in order on
its main thread, so all ranks apply between the same two model steps; ranks stage and fully
prepare a step (download, verify, decode, translate, move to device) before reporting it ready.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ._coordinator import Coordinator
from .config import SyncConfig, is_configured
from .errors import ApplyError, ChainError, DeltaSyncError

logger = logging.getLogger(__name__)

_TICK = "deltasync-tick"
_EXTENSION_NAMES = ("DeltaSyncExtension",)


# --------------------------------------------------------------------------- worker side
class _RankState:
    """Everything one rank keeps: config, shard map, poller, counters, the step trace."""

    def __init__(self, worker: Any, config: SyncConfig) -> None:
        from .manifest import fingerprint
        from .metrics import WorkerStats
        from .poller import Poller
        from .shardmap import ShardMap

        self.config = config
        self.rank = int(getattr(worker, "rank", 0))
        self.model = worker.model_runner.model
        params = checkpoint_params(worker.vllm_config.model_config.model)
        self.checkpoint = params
        self.shardmap = ShardMap.from_model(self.model, params)
        self.param_ids = _param_ids(self.model)
        self.fingerprint = fingerprint((n, s, d) for n, (s, d) in params.items())
        self.stats = WorkerStats()
        self.trace: collections.deque[tuple[int, int, int, int]] = collections.deque(
            maxlen=config.debug_ring_size
        )
        self.model_steps = 0
        self.last_apply: dict[str, Any] | None = None
        self.last_error: str | None = None
        names = set(self.shardmap.names)
        self.poller = Poller(
            config,
            self.prepare,
            select=lambda n: n not in names or bool(self.shardmap.targets(n)),
            fingerprint=self.fingerprint,
            applied_step=config.loaded_step,
            rank=self.rank,
            stats=self.stats,
        )

    def prepare(self, manifest: Any, patches: list[Any]) -> tuple[Any, int]:
        """Poller thread: translate to this rank's shards and move to the device."""
        from .apply import prepare
        from .shardmap import translate_all

        pieces = prepare(translate_all(self.shardmap, patches))
        if pieces and pieces[0].param.device.type == "cuda":
            torch.cuda.current_stream(pieces[0].param.device).synchronize()
        nbytes = sum(
            p.values.numel() * p.values.element_size()
            + (p.indices.numel() * p.indices.element_size() if p.indices is not None else 0)
            for p in pieces
        )
        return pieces, nbytes

    def apply(self, step: int) -> dict[str, Any]:
        """Main thread, between model steps: write every staged step up to ``step``."""
        from .apply import apply_patches

        self._check_params_unchanged()
        taken = self.poller.take(step)
        applied = self.poller.applied_step
        for staged in taken:  # check the whole chain before writing anything
            m = staged.manifest
            if m.kind == "delta" and m.base_step != applied:
                raise ChainError(
                    f"rank {self.rank}: step {m.step} applies on step {m.base_step}, "
                    f"the engine holds step {applied}"
                )
            applied = m.step
        started = time.perf_counter()
        written = 0
        for staged in taken:
            t0 = time.perf_counter()
            n = apply_patches(staged.payload)
            _synchronize(staged.payload)
            written += n
            self.poller.mark_applied(staged.manifest)
            kind = "anchor" if staged.manifest.kind == "anchor" else "delta"
            self.stats.add_apply(kind, time.perf_counter() - t0, n)
        self.last_apply = {
            "step": step,
            "steps": [s.step for s in taken],
            "kinds": [s.manifest.kind for s in taken],
            "apply_s": time.perf_counter() - started,
            "written": written,
            "downloaded_bytes": sum(s.downloaded_bytes for s in taken),
            "staged_bytes": sum(s.nbytes for s in taken),
            "changed": sum(s.manifest.totals.changed for s in taken),
            "numel": taken[-1].manifest.totals.elements,
            "published_at": taken[-1].manifest.created_at,
            "at": time.time(),
        }
        return dict(self.last_apply)

    def _check_params_unchanged(self) -> None:
        """vLLM's reload_weights may replace parameters: then re-derive the map, go to an anchor."""
        if _param_ids(self.model) == self.param_ids:
            return
        from .shardmap import ShardMap

        self.shardmap = ShardMap.from_model(self.model, self.checkpoint)
        self.param_ids = _param_ids(self.model)
        raise ApplyError(
            f"rank {self.rank}: the model's parameters were replaced (reload_weights?); the shard "
            "map was rebuilt and the engine resyncs through the next anchor"
        )

    def record_step(self, run: Callable[[], Any], num_tokens: int) -> Any:
        """Run one model step and remember which version it ran on, at start and at end."""
        before = _version(self.poller.applied_step)
        try:
            return run()
        finally:
            self.model_steps += 1
            self.trace.append(
                (self.model_steps, before, _version(self.poller.applied_step), num_tokens)
            )

    def status(self) -> dict[str, Any]:
        out = self.poller.status()
        if self.last_error and not out.get("last_error"):
            out["last_error"] = self.last_error
        out.update(
            fingerprint=self.fingerprint,
            last_apply=self.last_apply,
            model_steps=self.model_steps,
            pid=os.getpid(),
        )
        return out


def _param_ids(model: torch.nn.Module) -> frozenset[int]:
    return frozenset(id(p) for p in model.parameters())


def _version(step: int | None) -> int:
    return -1 if step is None else step


def _synchronize(pieces: list[Any]) -> None:
    if pieces and pieces[0].param.device.type == "cuda":
        torch.cuda.synchronize(pieces[0].param.device)


def checkpoint_params(model: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes of the checkpoint vLLM loaded (safetensors headers only)."""
    from safetensors import safe_open

    files = _safetensors_files(model)
    if not files:
        raise ApplyError(
            f"no *.safetensors found for model {model!r}; deltasync needs the checkpoint's "
            "parameter set to check the bucket against it (serve a safetensors checkpoint)"
        )
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                sl = f.get_slice(name)
                dtype = str(_ST_DTYPES.get(sl.get_dtype(), sl.get_dtype())).replace("torch.", "")
                out[name] = (tuple(sl.get_shape()), dtype)
    return out


_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "BOOL": "bool"}


def _safetensors_files(model: str) -> list[Path]:
    path = Path(model)
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, local_files_only=True,
                                          allow_patterns=["*.safetensors"]))
        except Exception:  # noqa: BLE001 - not in the local cache: reported by the caller
            return []
    return sorted(path.glob("*.safetensors"))


class DeltaSyncExtension:
    """Mixed into vLLM's worker by ``--worker-extension-cls vllm_deltasync.DeltaSyncExtension``.

    No ``__init__`` (vLLM never calls it) and every name is prefixed, because vLLM refuses an
    extension attribute the worker already has. The engine core calls these by
    ``collective_rpc``; users can too (``LLM.collective_rpc("deltasync_status")``).
    """

    _deltasync: _RankState | None

    def _deltasync_state(self) -> _RankState:
        state = getattr(self, "_deltasync", None)
        if state is None:
            raise DeltaSyncError("deltasync is not started on this worker (deltasync_start)")
        return state

    def deltasync_start(self) -> dict[str, Any]:
        """Build the shard map, start the poller and the step trace. Idempotent."""
        if getattr(self, "_deltasync", None) is not None:
            return self.deltasync_status()
        w: Any = self
        config = SyncConfig.from_sources(w.vllm_config.additional_config, os.environ)
        state = _RankState(w, config)
        self._deltasync = state
        inner = w.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
            return state.record_step(lambda: inner(scheduler_output, *args, **kwargs), tokens)

        w.execute_model = execute_model
        state.poller.start()
        logger.info("deltasync started rank=%d bucket=%s tensors=%d", state.rank,
                    config.redacted_url(), len(state.shardmap.names))
        return self.deltasync_status()

    def deltasync_status(self) -> dict[str, Any]:
        """This rank's status: applied/staged/newest step, last error, counters (metrics.py)."""
        return self._deltasync_state().status()

    def deltasync_ready(self) -> list[int]:
        """Steps staged and fully prepared on this rank, in apply order."""
        return self._deltasync_state().poller.ready_steps()

    def deltasync_apply(self, step: int) -> dict[str, Any]:
        """Apply every staged step up to ``step`` in place. Returns what was done, or the error."""
        state = self._deltasync_state()
        try:
            return {"ok": True, "rank": state.rank, **state.apply(step)}
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, never raised
            state.last_error = f"{type(exc).__name__}: {exc}"
            logger.exception("deltasync apply step=%d rank=%d failed", step, state.rank)
            state.poller.reset(state.last_error)
            return {"ok": False, "rank": state.rank, "error": state.last_error}

    def deltasync_reset(self, reason: str) -> None:
        """Forget the applied version (the next step is reached through an anchor)."""
        self._deltasync_state().poller.reset(reason)

    def deltasync_trace(self, last: int | None = None) -> list[tuple[int, int, int, int]]:
        """Recent model steps on this rank: (n, version at start, version at end, tokens)."""
        trace = list(self._deltasync_state().trace)
        return trace[-last:] if last else trace

    def deltasync_weight_digests(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """sha256 of the live elements of each checkpoint tensor held by this rank."""
        from .apply import tensor_digest

        state = self._deltasync_state()
        return {n: tensor_digest(state.shardmap, n) for n in _digest_names(state, names)}

    def deltasync_checkpoint_digests(self, path: str,
                                     names: Iterable[str] | None = None) -> dict[str, str]:
        """The digests this rank would report if it held the checkpoint at ``path`` (a
        directory of ``*.safetensors`` or one file)."""
        from safetensors.torch import load_file

        from .apply import checkpoint_digest

        state = self._deltasync_state()
        tensors: dict[str, torch.Tensor] = {}
        for f in _safetensors_files(path):
            tensors.update(load_file(str(f)))
        if not tensors:
            raise ApplyError(f"no safetensors checkpoint at {path!r}")
        return {n: checkpoint_digest(state.shardmap, n, tensors[n])
                for n in _digest_names(state, names) if n in tensors}


def _digest_names(state: _RankState, names: Iterable[str] | None) -> list[str]:
    sm = state.shardmap
    chosen = list(names) if names is not None else sm.names
    return [n for n in chosen if n not in sm.ignored and n not in sm.covered_by]


def sha256_hex(t: torch.Tensor) -> str:
    """``sha256:<hex>`` of a tensor's raw bytes (what a TP=1 rank reports for a whole tensor)."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return "sha256:" + hashlib.sha256(data).hexdigest()


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


def register_plugin() -> None:
    """The ``vllm.general_plugins`` entry point: runs in every vLLM process at start."""
    _patch_cpu_gemm()
    _patch_engine_core()


def _patch_cpu_gemm() -> None:
    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_deltasync_patched", False):
        return

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if (isinstance(weight, torch.Tensor) and weight.ndim == 2 and not weight.is_meta
                and _active_config_is_ours()):
            layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]
            return
        original(layer, remove_weight)

    dispatch_cpu_unquantized_gemm._deltasync_patched = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def _active_config_is_ours() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    return extension_configured(get_current_vllm_config_or_none())


def _patch_engine_core() -> None:
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    if getattr(EngineCoreProc, "_deltasync_patched", False):
        return
    run_busy_loop = EngineCoreProc.run_busy_loop
    handle = EngineCoreProc._handle_client_request
    shutdown = EngineCore.shutdown

    def patched_run_busy_loop(self: Any) -> Any:
        if extension_configured(self.vllm_config) and getattr(self, "_deltasync_coord", None) is None:
            self._deltasync_coord = _start_coordinator(self)
        return run_busy_loop(self)

    def patched_handle(self: Any, request_type: Any, request: Any) -> None:
        coord = getattr(self, "_deltasync_coord", None)
        if request_type == EngineCoreRequestType.WAKEUP and request == _TICK:
            if coord is not None:
                coord.tick()
            return
        handle(self, request_type, request)

    def patched_shutdown(self: Any) -> None:
        coord = getattr(self, "_deltasync_coord", None)
        if coord is not None:
            coord.close()
        shutdown(self)

    def deltasync_engine_status(self: Any) -> dict[str, Any]:
        coord = getattr(self, "_deltasync_coord", None)
        return coord.engine_status() if coord is not None else {"active": False}

    patched_run_busy_loop.__wrapped__ = run_busy_loop  # type: ignore[attr-defined]
    EngineCoreProc.run_busy_loop = patched_run_busy_loop  # type: ignore[method-assign]
    EngineCoreProc._handle_client_request = patched_handle  # type: ignore[method-assign]
    EngineCore.shutdown = patched_shutdown  # type: ignore[method-assign]
    EngineCore.deltasync_engine_status = deltasync_engine_status  # type: ignore[attr-defined]
    EngineCoreProc._deltasync_patched = True  # type: ignore[attr-defined]


def _start_coordinator(engine: Any) -> Any:
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.engine import EngineCoreRequestType

    try:
        config = SyncConfig.from_sources(engine.vllm_config.additional_config, os.environ)
    except DeltaSyncError as exc:
        if not is_configured(engine.vllm_config.additional_config, os.environ):
            logger.warning("deltasync: %s; the engine serves its checkpoint only", exc)
            return None
        raise

    def wake() -> None:
        engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, _TICK))

    coord = Coordinator(engine, config, wake=wake, pause_states=PauseState)
    coord.start()
    return coord


__all__ = [
    "DeltaSyncExtension",
    "checkpoint_params",
    "extension_configured",
    "register_plugin",
    "sha256_hex",
]

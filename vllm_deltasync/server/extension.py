"""The worker extension: the methods vLLM mixes into each worker, called by ``collective_rpc``.

``vllm serve MODEL --worker-extension-cls vllm_deltasync.DeltaSyncExtension`` mixes
:class:`DeltaSyncExtension` into every worker. vLLM never calls an extension's ``__init__`` and
nothing calls its methods unless someone sends ``collective_rpc``: the engine core's
coordinator does (``server/engine/coordinator.py``, started by the plugin's hook on the engine
core, ``server/vllm/``): ``deltasync_start`` on every rank (each builds its shard map and proves
its writes), ``deltasync_follow`` (pollers start), then each tick ``deltasync_status`` and, when
*all* ranks have the same next step staged, ``deltasync_apply(step)`` followed by
``deltasync_commit`` (or ``deltasync_revert`` on every rank).

Why every rank switches before the same batch: ``collective_rpc`` from the engine core goes
through the same broadcast queue as ``execute_model``, and every worker runs them in order on
its main thread, so all ranks apply between the same two model steps; ranks stage and fully
prepare a step (download, verify, decode, translate, move to device) before reporting it ready.

What this module reads from vLLM's worker goes through ``server/vllm/worker.py``; it imports no
vLLM module itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import ApplyError, DeltaSyncError
from vllm_deltasync.server.engine.coordinator import FAIL_APPLY_RPC_ENV
from vllm_deltasync.server.messages import ApplyResult, RankStatus
from vllm_deltasync.server.vllm import surface
from vllm_deltasync.server.vllm import worker as vllm_worker
from vllm_deltasync.server.vllm.plugin import PLUGIN_REFUSALS, extension_configured, register_plugin
from vllm_deltasync.server.worker.rank import (
    RankState,
    checkpoint_params,
    digest_names,
    safetensors_files,
    sha256_hex,
)

logger = logging.getLogger(__name__)


class DeltaSyncExtension:
    """Mixed into vLLM's worker by ``--worker-extension-cls vllm_deltasync.DeltaSyncExtension``.

    No ``__init__`` (vLLM never calls it) and every name is prefixed, because vLLM refuses an
    extension attribute the worker already has. The engine core calls these by
    ``collective_rpc``; users can too (``LLM.collective_rpc("deltasync_status")``).
    """

    _deltasync: RankState | None
    _deltasync_drafter: RankState | None
    """The speculative drafter's state, when a drafter bucket is configured and it follows."""
    _deltasync_drafter_refused: str | None
    """Why the configured drafter does not follow on this rank (its policy still does)."""
    _deltasync_writing: int | None
    """The step whose apply started on this rank and has not answered yet."""

    def _deltasync_state(self, model: str = "policy") -> RankState:
        if model == "drafter":
            drafter = getattr(self, "_deltasync_drafter", None)
            if drafter is None:
                raise DeltaSyncError("no drafter follows on this worker: "
                                     + (getattr(self, "_deltasync_drafter_refused", None)
                                        or "neither drafter_url nor drafter_prefix is set"))
            return drafter
        if model != "policy":
            raise DeltaSyncError(f"model={model!r}: use 'policy' or 'drafter'")
        state = getattr(self, "_deltasync", None)
        if state is None:
            raise DeltaSyncError("deltasync is not started on this worker (deltasync_start)")
        return state

    def _deltasync_start_drafter(
            self, config: SyncConfig,
            bucket: Mapping[str, tuple[tuple[int, ...], str]] | None) -> None:
        """Build and prove the drafter's state (check 1, then check 2 with a forward through
        the drafter's own modules: no collective). A drafter that cannot follow is refused
        on its own, with the reason in the status; the policy is unaffected."""
        self._deltasync_drafter = None
        self._deltasync_drafter_refused = None
        if not config.follows_drafter:
            return
        from vllm_deltasync.server.worker.proof import ProofFailed

        w: Any = self
        rank = int(getattr(w, "rank", 0))
        missing = surface.cached_problems("drafter")
        if missing:
            self._deltasync_drafter_refused = (
                f"vLLM {surface.vllm_version()} lacks what the drafter's following relies on "
                f"({'; '.join(missing)}); the draft keeps its loaded weights, the policy follows")
            logger.error("deltasync rank %d: the drafter does not follow: %s", rank,
                         self._deltasync_drafter_refused)
            return
        source = vllm_worker.drafter_source(w)
        if source is None:
            self._deltasync_drafter_refused = (
                "drafter_url or drafter_prefix is set but this engine runs no draft model of "
                "its own (start it with speculative_config method 'draft_model' or 'eagle' "
                "and the draft's checkpoint)")
            logger.error("deltasync rank %d: the drafter does not follow: %s", rank,
                         self._deltasync_drafter_refused)
            return
        model, path = source
        try:
            drafter = RankState(w, config.for_drafter(), model=model, model_path=path,
                                role="drafter", bucket_params=bucket)
            classes = drafter.prove_values()
            drafter.prove_writes(classes, vllm_worker.module_forward(model), 1)
            drafter.finish_proof()
        except (DeltaSyncError, ProofFailed) as exc:
            self._deltasync_drafter_refused = f"{type(exc).__name__}: {exc}"
            logger.error("deltasync rank %d: the drafter does not follow: %s", rank,
                         self._deltasync_drafter_refused)
            return
        self._deltasync_drafter = drafter
        logger.info("deltasync rank %d drafter proof passed (%d classes)", rank, len(classes))

    def deltasync_start(self) -> RankStatus:
        """Build the shard map (learning the layouts kernels rearranged parameters into) and
        run check 1 of the startup proof. The poller starts only with ``deltasync_follow``,
        once every rank passed (``deltasync_prove``). Never raises: a rank that cannot follow
        answers ``refused`` with the reason. Idempotent."""
        if getattr(self, "_deltasync", None) is not None:
            return self.deltasync_status()
        w: Any = self
        rank = int(getattr(w, "rank", 0))
        vllm_worker.pipeline_buffers(w)  # serving needs them, following or not
        try:
            if PLUGIN_REFUSALS:
                raise DeltaSyncError(" ".join(PLUGIN_REFUSALS))
            config = SyncConfig.from_sources(vllm_worker.additional_config(w), os.environ)
            bucket = _bucket_params(w, config)
            state = RankState(w, config, layout_specs=vllm_worker.layout_source(w),
                              bucket_params=bucket)
        except DeltaSyncError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            logger.error("deltasync rank %d refuses to follow: %s", rank, reason)
            return {"rank": rank, "refused": reason, "last_error": reason, "applied_step": None,
                    "ready_steps": [], "newest_step": None}
        self._deltasync = state
        self._deltasync_start_drafter(config, bucket)
        vllm_worker.quiet_status_reads()
        vllm_worker.wrap_worker(w, state, also_close=self._deltasync_close_drafter)
        vllm_worker.watch_weight_writes(w, state)
        classes = state.prove_values()
        out = self.deltasync_status()
        out["proof_classes"] = classes
        return out

    def deltasync_prove(self, classes: list[str], again: bool = False) -> RankStatus:
        """Check 2 of the startup proof, a collective (``classes``: the union over ranks, in
        the same order everywhere). Answers the status, ``refused`` set when the proof failed
        on this rank (one log line names the parameter and the reason). ``again``: after a
        reload behind our back, on the rebuilt map (``RankState.start_reproof``)."""
        from vllm_deltasync.server.worker.proof import ProofFailed

        state = self._deltasync_state()
        w: Any = self
        world = vllm_worker.tensor_parallel_size(w)
        if again:
            state.start_reproof()
        state.prove_writes(list(classes), vllm_worker.probe_forward(w), world)
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

    def _deltasync_close_drafter(self) -> None:
        drafter = getattr(self, "_deltasync_drafter", None)
        if drafter is not None:
            drafter.close()

    def deltasync_follow(self) -> RankStatus:
        """Every rank passed its proof: start the poller (and the drafter's)."""
        state = self._deltasync_state()
        state.follow()
        drafter = getattr(self, "_deltasync_drafter", None)
        if drafter is not None and drafter.refused is None:
            drafter.follow()
            logger.info("deltasync drafter started rank=%d bucket=%s tensors=%d", drafter.rank,
                        drafter.config.redacted_url(), len(drafter.shardmap.names))
        logger.info("deltasync started rank=%d bucket=%s tensors=%d", state.rank,
                    state.config.redacted_url(), len(state.shardmap.names))
        return self.deltasync_status()

    def deltasync_stop(self, reason: str) -> RankStatus | None:
        """Some rank refused: this one never follows either (its poller stops)."""
        state = getattr(self, "_deltasync", None)
        if state is None:
            return None
        if state.refused is None:
            state.refuse(reason)
        drafter = getattr(self, "_deltasync_drafter", None)
        if drafter is not None and drafter.refused is None:
            drafter.refuse(reason)
        return self.deltasync_status()

    def deltasync_status(self) -> RankStatus:
        """This rank's status: applied/staged/newest step, last error, counters (metrics.py).
        Reading it changes nothing, except that a write behind our back noted since the last
        call is settled first (``RankState.settle_writes``: counted in ``reloads``)."""
        state = self._deltasync_state()
        state.settle_writes()
        out = state.status()
        drafter = getattr(self, "_deltasync_drafter", None)
        refused = getattr(self, "_deltasync_drafter_refused", None)
        if drafter is not None:
            out["drafter"] = drafter.status()
        elif refused is not None:
            out["drafter"] = {"model": "drafter", "rank": state.rank, "refused": refused,
                              "last_error": refused, "applied_step": None, "ready_steps": [],
                              "newest_step": None}
        return out

    def deltasync_ready(self, model: str = "policy") -> list[int]:
        """Steps staged and fully prepared on this rank, in apply order."""
        return self._deltasync_state(model).sync.ready_steps()

    def deltasync_apply(self, step: int, identity: str | None = None,
                        model: str = "policy") -> ApplyResult:
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

        state = self._deltasync_state(model)
        if model != "policy":  # the drafter: no failpoint, no half-written policy marker
            return _apply_answered(state, step, identity)
        _apply_rpc_failpoint(self, state.rank, step)  # test-only, raises out of the RPC
        self._deltasync_writing = step
        try:
            out = _apply_answered(state, step, identity)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                state.reset(f"{error} (escaped the apply: the weights are unknown)")
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            logger.error("deltasync apply step=%d rank=%d failed: %s", step, state.rank, error,
                         exc_info=exc)
            out = ApplyResult(ok=False, rank=state.rank, error=error, reverted=False)
        self._deltasync_writing = None
        return out

    def deltasync_commit(self, step: int, model: str = "policy") -> bool | None:
        """The engine core made the switch to ``step`` final (prefix cache reset, weight
        version set): drop its undo. True when that switch was pending on this rank, False
        when it was not (idempotent: the engine core sends it again after a failed commit
        broadcast); None when the commit failed here (logged; the switch stays pending)."""
        try:
            return self._deltasync_state(model).commit(step)
        except Exception:  # noqa: BLE001 - answered, never raised (see deltasync_apply)
            logger.exception("deltasync commit step=%d failed", step)
            return None

    def deltasync_revert(self, step: int, reason: str,
                         before: dict[str, Any] | None = None, model: str = "policy") -> bool:
        """Take back this rank's switch to ``step`` (another rank, the engine core or the
        apply broadcast itself failed it). True when the rank holds its weights from before
        that switch again: it had the switch pending and put it back, or its own apply failed
        and was put back already, or it never wrote ``step`` and still holds ``before`` (the
        ``applied_step``/``applied_id`` every rank held before the switch; then the step is
        dropped as on the other ranks and the rank waits for a newer anchor). Otherwise it
        forgets its applied step (resync through an anchor) and answers False. Never raises."""
        if model != "policy":
            return _revert_drafter(self._deltasync_state(model), step, reason)
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

    def deltasync_weight_digests(self, names: Iterable[str] | None = None,
                                 model: str = "policy") -> dict[str, str]:
        """sha256 of the live elements of each checkpoint tensor held by this rank
        (``model="drafter"``: of the drafter's)."""
        from vllm_deltasync.server.worker.apply import tensor_digest

        state = self._deltasync_state(model)
        return {n: tensor_digest(state.shardmap, n) for n in digest_names(state, names)}

    def deltasync_checkpoint_digests(self, path: str, names: Iterable[str] | None = None,
                                     model: str = "policy") -> dict[str, str]:
        """The digests this rank would report if it held the checkpoint at ``path`` (a
        directory of ``*.safetensors`` or one file)."""
        from safetensors.torch import load_file

        from vllm_deltasync.server.worker.apply import checkpoint_digest

        state = self._deltasync_state(model)
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


def _bucket_params(worker: Any, config: SyncConfig) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """With ``drafter_prefix``: the parameter set of the policy's bucket (the policy's
    checkpoint and the draft's, its names under the prefix), or None when this engine runs no
    draft model to read the draft's from. Without: None (each state checks its own set)."""
    if not config.drafter_prefix:
        return None
    source = vllm_worker.drafter_source(worker)
    if source is None:
        return None
    whole = dict(checkpoint_params(str(worker.vllm_config.model_config.model)))
    whole.update((config.drafter_prefix + n, v) for n, v in checkpoint_params(source[1]).items())
    return whole


def _apply_answered(state: RankState, step: int, identity: str | None) -> ApplyResult:
    """``state.apply`` answered, an ``Exception`` included (policy and drafter alike): a
    failure that could not be put back resets the state (it then waits for an anchor)."""
    from vllm_deltasync.server.worker.rank import ApplyFailed

    try:
        return ApplyResult(ok=True, rank=state.rank, **state.apply(step, identity=identity))
    except Exception as exc:  # noqa: BLE001 - reported to the coordinator, never raised
        error = f"{type(exc).__name__}: {exc}"
        logger.exception("deltasync %s apply step=%d rank=%d failed", state.role, step,
                         state.rank)
        reverted = isinstance(exc, ApplyFailed) and exc.reverted
        if not reverted:
            state.reset(error)
        return ApplyResult(ok=False, rank=state.rank, error=error, reverted=reverted)


def _revert_drafter(state: RankState, step: int, reason: str) -> bool:
    try:
        if state.sync.pending_step() is None:
            return True  # this rank's drafter apply failed and was put back (or never ran)
        return state.revert(step, reason)
    except Exception:  # noqa: BLE001 - answered, never raised
        logger.exception("deltasync drafter revert step=%d failed", step)
        with contextlib.suppress(Exception):
            state.reset(f"{reason}; the revert failed")
        return False


def _holds(state: RankState, before: dict[str, Any]) -> bool:
    """The rank's applied step (and identity, where both are known) is ``before``'s."""
    step, manifest = state.sync.applied
    if step != before.get("applied_step"):
        return False
    mine = getattr(manifest, "identity", None)
    theirs = before.get("applied_id")
    return mine is None or theirs is None or mine == theirs


__all__ = [
    "DeltaSyncExtension",
    "checkpoint_params",
    "extension_configured",
    "register_plugin",
    "sha256_hex",
]

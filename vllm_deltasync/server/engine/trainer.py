"""vLLM's weight-transfer API, backend ``deltasync``: the trainer drives the switch.

With ``--weight-transfer-config '{"backend": "deltasync"}'`` the ranks' pollers stage steps as
usual, but the targets the trainer drives (``SwitchPolicy.trainer_driven``: the policy) switch
only when the trainer calls vLLM's protocol: ``init_weight_transfer_engine({"url": ...})``
(the trainer's bucket must be this server's), ``start_weight_update``,
``update_weights({"step": N, "identity": ...})`` (taken by the engine core: :func:`update_to`
waits until every rank has step N staged, then switches it as a tick would),
``finish_weight_update``. Out-of-order calls are refused with the order to follow
(:class:`Protocol`). The engine-core hook that routes these calls is ``server/vllm/engine.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm_deltasync._urls import redact_url, strip_userinfo
from vllm_deltasync.server.engine.ready import staged_target
from vllm_deltasync.server.engine.switch import CommitFailed, SwitchFailed

if TYPE_CHECKING:
    from vllm_deltasync.server.engine.coordinator import Coordinator

logger = logging.getLogger(__name__)

BACKEND = "deltasync"
"""The weight-transfer backend name (``--weight-transfer-config '{"backend": "deltasync"}'``)."""

ORDER = "init_weight_transfer_engine, start_weight_update, update_weights, finish_weight_update"


class WeightUpdateRefused(RuntimeError):
    """The trainer's ``update_weights`` did not switch: the message names the step and why
    (raised to the caller of vLLM's ``update_weights``)."""


class Protocol:
    """Where one engine core is in vLLM's weight-transfer protocol (:data:`ORDER`)."""

    def __init__(self) -> None:
        self.initialized = False
        self.updating = False

    def init(self) -> None:
        self.initialized = True

    def start(self) -> None:
        if not self.initialized:
            raise WeightUpdateRefused(f"start_weight_update before init_weight_transfer_engine; "
                                      f"weight-transfer backend {BACKEND!r} takes calls in the "
                                      f"order {ORDER}")
        if self.updating:
            raise WeightUpdateRefused("start_weight_update while an update is active; call "
                                      "finish_weight_update first")
        self.updating = True

    def update(self) -> None:
        if not self.initialized or not self.updating:
            missing = ("init_weight_transfer_engine" if not self.initialized
                       else "start_weight_update")
            raise WeightUpdateRefused(f"update_weights without {missing} first; weight-transfer "
                                      f"backend {BACKEND!r} takes calls in the order {ORDER}")

    def finish(self) -> None:
        if not self.updating:
            raise WeightUpdateRefused("finish_weight_update without start_weight_update; "
                                      f"weight-transfer backend {BACKEND!r} takes calls in the "
                                      f"order {ORDER}")
        self.updating = False


def conflict(backend: str | None) -> str | None:
    """Why a deltasync bucket cannot be followed together with this engine's weight-transfer
    ``backend`` (one line), or None. Any backend but ``deltasync`` writes the weights by its
    own transport, behind the coordinator's back, so the extension refuses at start."""
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
                         f"{type(update_info).__name__}")
    pairs = set()
    for info in infos:
        unknown = set(info) - {"step", "identity"}
        if unknown or "step" not in info:
            raise ValueError(f"deltasync update_info takes 'step' (required) and 'identity', got "
                             f"keys {sorted(map(str, info))}")
        pairs.add((info["step"], info.get("identity")))
    if len(pairs) != 1:
        raise ValueError(f"deltasync update_info differs between workers: {sorted(pairs, key=str)}")
    return next(iter(pairs))


def same_bucket(a: str, b: str) -> bool:
    """Two URLs name the same bucket: equal without credentials, a trailing ``/`` and the
    scheme's case."""

    def normal(url: str) -> str:
        scheme, sep, rest = strip_userinfo(str(url).strip()).partition("://")
        return (scheme.lower() + sep + rest).rstrip("/")

    return normal(a) == normal(b)


def check_init(coord: Coordinator | None, init_info: Any) -> None:
    """``init_weight_transfer_engine``, in the engine core: a coordinator that refused says
    why; a trainer's bucket other than this server's is an error. No coordinator (no bucket
    configured): the workers' receiver says what is missing."""
    if coord is None:
        return
    if not coord.active:
        raise RuntimeError("init_weight_transfer_engine: weight-transfer backend 'deltasync': "
                           f"deltasync does not follow on this server: {coord.last_error}")
    url = init_info.get("url") if isinstance(init_info, Mapping) else None
    if url is not None and not same_bucket(str(url), coord.config.url):
        raise ValueError(
            f"init_weight_transfer_engine: weight-transfer backend 'deltasync': the trainer "
            f"publishes to {redact_url(str(url))} but this server follows "
            f"{coord.config.redacted_url()} (VLLM_DELTASYNC_URL / additional_config "
            "deltasync.url); give both the same bucket")


def update_to(coord: Coordinator, step: Any, identity: Any = None, *,
              wait_s: float | None = None) -> dict[str, Any]:
    """The trainer's ``update_weights``, on the busy-loop thread (the engine core schedules no
    batch meanwhile): wait, at most ``wait_s`` (default ``update_wait_s``), until every rank
    has step ``N`` of the primary target staged, then switch to it as a tick would.

    Step ``N`` already applied (same identity): nothing to do. Older than the applied step,
    applied with another identity, not staged in time, or taken back: a
    :class:`WeightUpdateRefused` naming the step and why."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise WeightUpdateRefused(f"update_weights: step={step!r} must be an integer >= 0 "
                                  "(the bucket step the trainer published)")
    if identity is not None and not isinstance(identity, str):
        raise WeightUpdateRefused(f"update_weights: identity={identity!r} must be a string "
                                  "(the manifest identity) or None")
    if not coord.active:
        raise WeightUpdateRefused(
            f"update_weights to step {step}: deltasync does not follow on this server: "
            f"{coord.last_error or 'the coordinator is not active'}")
    follower = coord.primary
    wait_s = coord.config.update_wait_s if wait_s is None else float(wait_s)
    deadline = time.monotonic() + wait_s
    while True:
        coord.ranks = coord.read_statuses()
        coord.metrics.update(coord.ranks)
        coord.check_reloads()
        if not coord.active:
            raise WeightUpdateRefused(f"update_weights to step {step}: deltasync stopped "
                                      f"following: {coord.last_error}")
        follower.statuses = coord.statuses
        done = _applied_already(coord, step, identity)
        if done is not None:
            return done
        busy = follower.held is not None and follower.resync_held()
        if not busy and not follower.settle_pending():
            target = staged_target(follower.statuses, step, identity)
            if target is not None:
                return _switch(coord, *target)
        if time.monotonic() >= deadline:
            raise WeightUpdateRefused(_not_staged(coord, step, identity, wait_s))
        time.sleep(0.05)


def _applied_already(coord: Coordinator, step: int,
                     identity: str | None) -> dict[str, Any] | None:
    """The no-op answer when every rank has ``step`` applied; raise when the applied step is
    newer, or ``step`` with another identity; None otherwise (wait and switch)."""
    applied = {s.applied for s in coord.statuses}
    if len(applied) != 1 or coord.primary.held is not None:
        return None
    (applied_step, applied_id), = applied
    if applied_step is None:
        return None
    if step < applied_step:
        raise WeightUpdateRefused(
            f"update_weights to step {step} refused: this server applied step {applied_step}, "
            "which is newer (a step older than the applied one never applies; publish a new "
            "step)")
    if step != applied_step:
        return None
    if identity is not None and applied_id is not None and applied_id != identity:
        raise WeightUpdateRefused(
            f"update_weights to step {step} refused: this server applied step {step} of "
            f"another manifest (identity {applied_id}, the trainer's is {identity}): another "
            "writer, or a restarted trainer reusing the step number")
    return {"step": step, "identity": applied_id, "switched": False}


def _switch(coord: Coordinator, step: int, identity: str | None) -> dict[str, Any]:
    follower = coord.primary

    def refused(why: str) -> str:
        state = (f"the engine holds: {follower.held}" if follower.held is not None
                 else f"every rank took it back, serving version "
                      f"{coord.engine.get_weight_version()}")
        return f"update_weights to step {step} failed: {why}; {state}"

    try:
        switched = follower.switch(step, identity)
    except CommitFailed as exc:  # the switch stands; the commit is sent again at a tick
        logger.warning("deltasync: %s", exc)
        switched = True
    except SwitchFailed as exc:
        raise WeightUpdateRefused(refused(str(exc))) from exc
    if not switched:
        raise WeightUpdateRefused(refused(str(follower.last_error)))
    record = follower.switches[-1] if follower.switches else None
    return {"step": step, "identity": identity, "switched": True,
            "pause_s": record.pause_s if record is not None else None}


def _not_staged(coord: Coordinator, step: int, identity: str | None, wait_s: float) -> str:
    ranks = "; ".join(
        f"rank {s.rank}: applied={s.applied_step} ready={list(s.ready_steps)} "
        f"newest={s.newest_step} error={s.last_error}" for s in coord.statuses)
    which = f" with identity {identity}" if identity is not None else ""
    held = (f"; the engine holds: {coord.primary.held}" if coord.primary.held is not None
            else "")
    return (f"update_weights to step {step}: step {step}{which} is not staged on every rank "
            f"after {wait_s:g}s (update_wait_s); is it committed to "
            f"{coord.config.redacted_url()}?{held} Ranks: {ranks}")


__all__ = ["BACKEND", "ORDER", "Protocol", "WeightUpdateRefused", "check_init", "conflict",
           "same_bucket", "update_info_step", "update_to"]

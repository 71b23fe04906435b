"""The engine-core side of the switch: when every rank has the same step staged, apply it.

Runs on the engine core's busy-loop thread, between two scheduler steps (the extension's
plugin calls :meth:`Coordinator.tick` when the private wake-up it queued is handled). It talks
to the ranks only through ``engine.collective_rpc``, which every worker executes in order with
``execute_model``: an apply broadcast between two steps lands on all ranks between the same two
model steps. No vLLM import here; the engine object and vLLM's ``PauseState`` are passed in.

A switch is one unit whatever fails (``switch.py``, driven by :meth:`Coordinator._switch`). From the first
``deltasync_apply`` reaching a rank to the commit, any failure (a rank's answer, the apply
broadcast itself raising or timing out, the engine core's own steps) is taken back on every
rank before the next batch (``deltasync_revert``), or, when some rank cannot take it back or
the revert broadcast fails too, the engine holds (:meth:`Coordinator._hold`): no batch is
scheduled, the weight version is ``inconsistent``, ``/synced`` answers 503 with the reason,
every rank forgets its step and resyncs through an anchor (the newest one not on a chain
through a step it failed, so possibly the next anchor the trainer publishes), and scheduling
resumes only after a switch that every rank applied and every rank then reports (same applied
step and identity).

The commit broadcast comes after the weights, the prefix cache and the version label all are
the new step: it only drops the ranks' undo. If it fails, the switch stands (nothing is taken
back: every rank wrote the step and the label says so); the ranks that did not commit report a
``pending_switch``, the next ticks send the commit again (it is idempotent: a rank without that
pending switch answers False), and no switch starts while any rank reports a pending switch. A
pending switch the coordinator did not leave (someone called ``deltasync_apply`` by hand)
holds the engine: it cannot tell what the weights are.

The ranks' switch RPCs never raise on purpose (they answer the failure): vLLM's multiprocessing
executor stops reading answers at the first rank whose RPC raised, and the later ranks' answers
would then be read by the next broadcast. Answers are checked for their shape and rank, so a
misplaced answer counts as a failure, never as a success.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vllm_deltasync._urls import redact_text
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.failpoints import FAIL_APPLY_RPC_ENV, FAIL_SWITCH_ENV, SWITCH_EVERY_STEPS_ENV
from vllm_deltasync.format.manifest import SCHEMA_VERSION
from vllm_deltasync.server.engine.drafter import DrafterFollower
from vllm_deltasync.server.engine.switch import (
    CommitFailed,
    Failpoint,
    Switch,
    SwitchFailed,
    SwitchHeld,
)
from vllm_deltasync.server.engine.switch import fatal as _fatal
from vllm_deltasync.server.messages import EngineStatus, RankStatus
from vllm_deltasync.server.metrics import MetricsServer, SyncMetrics

logger = logging.getLogger(__name__)

FAILING_AFTER = 3
"""Consecutive failed ticks after which the coordinator reports itself failing (``/synced``
answers 503, ``deltasync_coordinator_failing`` is 1) until a tick succeeds."""

STAGED_TICKS = 10
"""Ticks a staged step may wait for its switch before :meth:`Coordinator._watch_staged` logs
every rank's status (at the default 2 s poll interval, 20 s)."""


def _ready_pairs(status: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    """(step, identity) of each ready step; identity None where the rank reports none."""
    steps = list(status.get("ready_steps") or ())
    ids: list[Any] = list(status.get("ready_ids") or ())[:len(steps)]
    ids += [None] * (len(steps) - len(ids))
    return list(zip(steps, ids, strict=True))


def common_ready(statuses: Sequence[Mapping[str, Any]]) -> tuple[int, str | None] | None:
    """The newest (step, identity) every rank has staged on top of the same applied step, or
    None. Identity-aware: the ranks must report the same ``applied_step`` and ``applied_id``,
    and the same (step, id) pairs (``ready_steps`` / ``ready_ids``) in order, up to the step.
    A status without those keys (an older rank) counts as identity None, i.e. steps only."""
    if not statuses or len({(s.get("applied_step"), s.get("applied_id"))
                            for s in statuses}) != 1:
        return None
    common: tuple[int, str | None] | None = None
    for pairs in zip(*(_ready_pairs(s) for s in statuses), strict=False):
        if len(set(pairs)) != 1:
            break
        common = (int(pairs[0][0]), pairs[0][1])
    return common


def common_after_reset(statuses: Sequence[Mapping[str, Any]]) -> tuple[int, str | None] | None:
    """While the engine holds and every rank forgot its applied step: the newest (step,
    identity) every rank has ready, whatever else each staged before it. Each rank's chain
    from nothing starts at an anchor and ends at that very manifest, so every rank ends on the
    same weights (ranks that failed a step wait for different anchors, so their queues need
    not share a prefix). None unless every rank reports no applied step."""
    if not statuses or any(s.get("applied_step") is not None for s in statuses):
        return None
    common = set.intersection(*(set(_ready_pairs(s)) for s in statuses))
    if not common:
        return None
    step, identity = max(common, key=lambda pair: pair[0])
    return int(step), identity


def staged_target(statuses: Sequence[Mapping[str, Any]], step: int, identity: str | None, *,
                  after_reset: bool = False) -> tuple[int, str | None] | None:
    """(step, identity as the ranks report it) when every rank has ``step`` staged, ready to
    switch to, or None. As :func:`common_ready`: the ranks on the same applied step (and
    identity) with the same (step, id) pairs up to ``step``; ``after_reset`` (the engine holds
    and every rank forgot its step): ``step`` among every rank's ready pairs, as
    :func:`common_after_reset`. ``identity`` (the trainer's manifest identity), where both it
    and the ranks name one, must be the ranks' (a delta never applies onto other weights)."""
    if not statuses:
        return None
    candidates: list[tuple[Any, Any]] = []
    if after_reset:
        if any(s.get("applied_step") is not None for s in statuses):
            return None
        common = set.intersection(*(set(_ready_pairs(s)) for s in statuses))
        candidates = [pair for pair in common if pair[0] == step]
    elif len({(s.get("applied_step"), s.get("applied_id")) for s in statuses}) == 1:
        for pairs in zip(*(_ready_pairs(s) for s in statuses), strict=False):
            if len(set(pairs)) != 1:
                break
            if pairs[0][0] == step:
                candidates = [pairs[0]]
                break
    for found, found_id in candidates:
        if identity is None or found_id is None or found_id == identity:
            return int(found), found_id
    return None


class WeightUpdateRefused(RuntimeError):
    """The trainer's ``update_weights`` (weight-transfer backend ``deltasync``) did not switch:
    the message names the step and why (raised to the caller of vLLM's ``update_weights``)."""


def common_ready_step(statuses: Sequence[Mapping[str, Any]]) -> int | None:
    """The step of :func:`common_ready`, or None."""
    found = common_ready(statuses)
    return None if found is None else found[0]


class Coordinator:
    """Decides when all ranks switch; resets the prefix cache; sets the weight version."""

    def __init__(self, engine: Any, config: SyncConfig, *, wake: Callable[[], None] | None,
                 pause_states: Any, trainer_driven: bool = False) -> None:
        self.engine = engine
        self.config = config
        self.trainer_driven = trainer_driven
        """vLLM's weight-transfer API with backend ``deltasync``: the ranks' pollers stage steps
        as usual, but only the trainer's ``update_weights`` switches (:meth:`update_to`); a
        tick switches only to release a hold (docs/extension.md)."""
        self._wake = wake
        self._pause = pause_states
        self.metrics = SyncMetrics(bucket_url=config.url, format_version=SCHEMA_VERSION)
        self.server: MetricsServer | None = None
        self.switches: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
        self.statuses: list[RankStatus] = []
        self._last_error: str | None = None
        self.active = False
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._drain_since: float | None = None
        self._paused_by_us = False
        self.held: str | None = None
        """Why scheduling is held (:meth:`_hold`), None when it is not."""
        self.holds: collections.deque[dict[str, Any]] = collections.deque(maxlen=64)
        """Every hold: when, why, and when and at which step it was released."""
        self._last_switched: int | None = None
        """The step of the last switch that stands (its commit may still be pending)."""
        self.failed_ticks = 0
        """Consecutive ticks that raised (0 after a good one)."""
        self._logged_error: str | None = None
        self._failpoint = Failpoint(os.environ.get(FAIL_SWITCH_ENV))
        self._switch_every = int(os.environ.get(SWITCH_EVERY_STEPS_ENV) or 0)
        self._model_steps = 0
        self._reloads = 0
        """Reloads behind our back the ranks have reported (``reloads`` in their status)."""
        self._label: str | None = None
        """The weight version this coordinator last set (a step), to tell it from a user's."""
        self._proof_classes: list[str] = []
        self._last_tick = float("-inf")
        self.drafter = DrafterFollower(engine)
        """The speculative drafter's switches (``drafter_url``; server/engine/drafter.py)."""
        self._staged: tuple[tuple[Any, ...], int, bool] | None = None
        """What the ranks had staged at the last ticks, for how many ticks, logged or not."""

    @property
    def last_error(self) -> str | None:
        """The last failure, URLs and secrets redacted (served by ``/synced`` and the status)."""
        return self._last_error

    @last_error.setter
    def last_error(self, text: str | None) -> None:
        self._last_error = None if text is None else redact_text(text)

    # ----------------------------------------------------------------- lifecycle
    def start(self, refuse: str | None = None) -> None:
        """Prove every rank (``deltasync_start``, then the collective ``deltasync_prove``),
        start the metrics endpoint, then the pollers (``deltasync_follow``) and the wake-up
        timer (none when ``wake`` is None: the in-process engine core ticks from its client).
        If any rank refuses, no rank follows (``deltasync_stop``); the engine serves its
        checkpoint, and ``/metrics`` and ``/synced`` (503) say why. ``refuse``: a reason known
        before any rank is asked (an engine layout that cannot switch safely): the same
        refusal, without starting any rank."""
        if refuse is not None:
            self.last_error = refuse
            self._start_metrics()
            self._refuse(refuse)
            return
        try:
            self.statuses = list(self.engine.collective_rpc("deltasync_start"))
            if not self._refused():
                classes = sorted({c for s in self.statuses for c in s.get("proof_classes") or ()})
                self._proof_classes = classes
                self.statuses = list(self.engine.collective_rpc("deltasync_prove",
                                                                args=(classes,)))
        except Exception as exc:  # noqa: BLE001 - the server keeps serving its checkpoint
            self.last_error = f"{type(exc).__name__}: {exc}"
        else:
            self.last_error = self._refused()
        self._start_metrics()
        if self.last_error is not None:
            self._refuse(self.last_error)
            return
        self.statuses = list(self.engine.collective_rpc("deltasync_follow"))
        self.active = True
        if self._wake is not None:
            self._timer = threading.Thread(target=self._run_timer, name="deltasync-wake",
                                           daemon=True)
            self._timer.start()
        logger.info("deltasync following %s with %d rank(s), poll every %.2fs",
                    self.config.redacted_url(), len(self.statuses), self.config.poll_interval_s)

    def _refused(self) -> str | None:
        reasons = [f"rank {s.get('rank', i)}: {s['refused']}"
                   for i, s in enumerate(self.statuses) if s.get("refused")]
        return "; ".join(reasons) or None

    def _start_metrics(self) -> None:
        if self.config.metrics_port:
            try:
                self.server = self.metrics.start_server(self.config.metrics_port,
                                                        self.config.metrics_host)
            except Exception as exc:  # noqa: BLE001 - metrics are optional
                logger.error("deltasync metrics endpoint not started: %s", exc)

    def _refuse(self, reason: str) -> None:
        """No rank follows; the refusal is visible (log, /synced 503, deltasync_failing)."""
        logger.error("deltasync refuses to follow; the engine serves its loaded checkpoint "
                     "and applies no step: %s", reason)
        try:
            stopped = self.engine.collective_rpc("deltasync_stop", args=(reason,))
            self.statuses = [s for s in stopped if s is not None] or self.statuses
        except Exception as exc:  # noqa: BLE001 - still report the refusal
            logger.error("deltasync could not stop every rank: %s", exc)
        if not self.statuses:
            self.statuses = [{"rank": 0, "last_error": reason, "applied_step": None}]
        self.metrics.update(self.statuses)
        self.metrics.coordinator_state(failing=True, error=RuntimeError(reason))

    def close(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.close()
            self.server = None

    def _run_timer(self) -> None:
        assert self._wake is not None
        while not self._stop.wait(self.config.poll_interval_s):
            try:
                self._wake()
            except Exception:  # noqa: BLE001 - queue gone: the engine is shutting down
                return

    # ---------------------------------------------------------------------- tick
    def tick(self, *, from_steps: bool = False) -> None:
        """Busy-loop thread, between scheduler steps. Never raises: a failed tick is counted
        (``deltasync_coordinator_failures_total``), logged with its traceback once per distinct
        error, and after :data:`FAILING_AFTER` in a row the coordinator reports itself failing.
        While the engine holds (:meth:`_hold`) it reports itself failing whatever the ticks do.
        """
        if not self.active:
            return
        self._last_tick = time.monotonic()
        try:
            self._failpoint.at_tick()
            self._tick(may_switch=from_steps or not self._switch_every
                       or self._drain_since is not None)
        except BaseException as exc:  # noqa: BLE001 - never take the engine down
            if _fatal(exc):
                raise
            self._tick_failed(exc)
        else:
            self.failed_ticks = 0
            self.metrics.coordinator_state(failing=self.held is not None)

    def tick_if_due(self) -> None:
        """A tick, unless one ran less than ``poll_interval_s`` ago (the in-process engine
        core, which has no busy loop and no wake-up timer, calls this before each step)."""
        if time.monotonic() - self._last_tick >= self.config.poll_interval_s:
            self.tick()

    def after_model_step(self) -> None:
        """Busy-loop thread, after a model step ran (test hook :data:`SWITCH_EVERY_STEPS_ENV`)."""
        if not self._switch_every:
            return
        self._model_steps += 1
        if self._model_steps >= self._switch_every:
            self._model_steps = 0
            self.tick(from_steps=True)


    def _tick_failed(self, exc: BaseException) -> None:
        self.failed_ticks += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        failing = self.failed_ticks >= FAILING_AFTER or self.held is not None
        error = exc if self.held is None else SwitchHeld(
            f"{self.held}; a tick failed while holding: {self.last_error}")
        self.metrics.coordinator_state(failing=failing, error=error)
        if self.last_error != self._logged_error:
            self._logged_error = self.last_error
            trace = redact_text("".join(traceback.format_exception(exc)))
            logger.error("deltasync tick failed (%d in a row; this error is logged once): %s\n%s",
                         self.failed_ticks, self.last_error, trace)

    def after_utility(self) -> None:
        """Busy-loop thread, right after a client's utility call that may have written the
        weights (``collective_rpc("reload_weights")``, for example) and before the next batch:
        a tick notices a reload before any request is served under the old label."""
        self.tick()


    def _tick(self, *, may_switch: bool) -> None:
        self.statuses = list(self.engine.collective_rpc("deltasync_status"))
        self.metrics.update(self.statuses)
        self._check_reloads()
        if not self.active:
            return
        self.drafter.tick(self.statuses, may_switch=may_switch)
        self._watch_staged()
        if self.held is not None and self._resync_held():
            return
        if self._settle_pending():
            return
        found = common_ready(self.statuses)
        if found is None and self.held is not None:
            found = common_after_reset(self.statuses)
        if found is None:
            self._release_drain()
            return
        if not may_switch or (self.trainer_driven and self.held is None):
            return
        if self.config.in_flight == "drain" and not self._drained():
            return
        self._switch(*found)

    def _watch_staged(self) -> None:
        """A step staged on some rank that is not switched for :data:`STAGED_TICKS` ticks in a
        row (the ranks' staged and applied steps unchanged) is logged once, with every rank's
        status and why the coordinator waits: a stall is visible in the log, not only as a
        server falling behind (issue 24)."""
        key = tuple((s.get("rank", i), s.get("applied_step"), tuple(s.get("ready_steps") or ()))
                    for i, s in enumerate(self.statuses))
        if not any(ready for _, _, ready in key):
            self._staged = None
            return
        if self._staged is None or self._staged[0] != key:
            self._staged = (key, 1, False)
            return
        _, ticks, logged = self._staged
        ticks += 1
        self._staged = (key, ticks, logged)
        if logged or ticks < STAGED_TICKS:
            return
        self._staged = (key, ticks, True)
        why = ("held: " + self.held if self.held is not None
               else "trainer-driven: waiting for the trainer's update_weights"
               if self.trainer_driven
               else "draining" if self._drain_since is not None
               else "no step staged on every rank" if common_ready(self.statuses) is None
               else "a switch is due")
        ranks = "; ".join(
            f"rank {s.get('rank', i)}: applied={s.get('applied_step')} "
            f"ready={s.get('ready_steps')} staged={s.get('staged_step')} "
            f"newest={s.get('newest_step')} pending={s.get('pending_switch')} "
            f"error={s.get('last_error')}" for i, s in enumerate(self.statuses))
        logger.warning("deltasync: a staged step has not been switched for %d ticks (%s); %s",
                       ticks, why, ranks)

    def _check_reloads(self) -> None:
        """A rank saw its weights written behind our back (vLLM's ``reload_weights``): it
        forgot its applied step and resyncs through the newest anchor. Until that anchor's
        switch the weights are whatever was loaded, so the step label is withdrawn
        (``unknown``; a label the user set after the reload is left alone) and the prefix
        cache, computed with the old weights, is dropped."""
        reloads = sum(int(s.get("reloads") or 0) for s in self.statuses)
        if reloads <= self._reloads:
            return
        self._reloads = reloads
        if self.config.reset_prefix_cache:
            self.engine.reset_prefix_cache(reset_running_requests=True)
        label = self.engine.get_weight_version()
        if self._label is not None and label == self._label:
            self.engine.set_weight_version("unknown")
            self._label = None
        logger.warning("deltasync: the weights were reloaded outside deltasync (weight version "
                       "was %s, now %s); proving the rebuilt map again, then resyncing through "
                       "the newest anchor", label, self.engine.get_weight_version())
        self.statuses = list(self.engine.collective_rpc(
            "deltasync_prove", args=(self._proof_classes,), kwargs={"again": True}))
        reason = self._refused()
        if reason is not None:
            self.last_error = f"after a reload: {reason}"
            self._refuse(self.last_error)
            self.active = False

    def _drained(self) -> bool:
        sched = self.engine.scheduler
        if not sched.has_unfinished_requests():
            return True
        now = time.monotonic()
        if self._drain_since is None:
            self._drain_since = now
            if sched.pause_state == self._pause.UNPAUSED:
                sched.set_pause_state(self._pause.PAUSED_NEW)
                self._paused_by_us = True
        if now - self._drain_since >= self.config.max_drain_wait_s:
            logger.warning("deltasync: requests still running after %.1fs of drain; switching",
                           now - self._drain_since)
            return True
        return False


    def _release_drain(self) -> None:
        self._drain_since = None
        if self._paused_by_us:
            self._paused_by_us = False
            if self.held is None:  # a hold keeps everything paused until it is released
                self.engine.scheduler.set_pause_state(self._pause.UNPAUSED)

    # -------------------------------------------------------------------- switch
    def _switch(self, step: int, identity: str | None = None) -> bool:
        """One unit (``switch.py``: every rank applies ``step``, the prefix cache is reset,
        the weight version is set, every rank commits; anything else is taken back on every
        rank), then what outlives it: the label, the hold (:meth:`_hold` when the outcome says
        some rank could not take it back), the drain, metrics. A switch that succeeds while the
        engine holds releases the hold once every rank reports that step
        (:meth:`_release_hold`). True when the switch stands (a :class:`CommitFailed` raised
        after it says the same), False when it was taken back."""
        out = Switch(self.engine, self.config, self.statuses, self._failpoint).run(step, identity)
        if not out.switched:
            self.last_error = out.reason
            if out.hold:
                self._hold()
            else:
                self._release_drain()
            if out.error is not None:
                raise out.error
            return False
        self._label = str(step)
        self._last_switched = step
        if self.held is not None:
            self._release_hold(step)
        self._release_drain()
        self.metrics.observe_switch(step, out.pause_s)
        self.last_error = None
        assert out.record is not None
        self.switches.append(out.record)
        logger.info("deltasync switched step=%d ranks=%d pause=%.4fs", step,
                    len(out.record["apply_s"]), out.pause_s)
        if out.commit_error is not None:
            raise CommitFailed(out.commit_error)
        return True

    # ------------------------------------------------------ trainer-driven (weight transfer)
    def update_to(self, step: Any, identity: Any = None, *,
                  wait_s: float | None = None) -> dict[str, Any]:
        """The trainer's ``update_weights({"step": N, "identity": ...})`` (vLLM's weight-transfer
        API, backend ``deltasync``), on the busy-loop thread (the engine core schedules no batch
        meanwhile): wait, at most ``wait_s`` (default ``update_wait_s``), until every rank has
        step ``N`` staged, then switch to it as a tick would (:meth:`_switch`: every rank, the
        prefix cache, the weight version, the commit; or taken back on every rank).

        Step ``N`` already applied (same identity): nothing to do. Older than the applied step,
        applied with another identity, not staged in time, or taken back: a
        :class:`WeightUpdateRefused` naming the step and why."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise WeightUpdateRefused(f"update_weights: step={step!r} must be an integer >= 0 "
                                      "(the bucket step the trainer published)")
        if identity is not None and not isinstance(identity, str):
            raise WeightUpdateRefused(f"update_weights: identity={identity!r} must be a string "
                                      "(the manifest identity) or None")
        if not self.active:
            raise WeightUpdateRefused(
                f"update_weights to step {step}: deltasync does not follow on this server: "
                f"{self.last_error or 'the coordinator is not active'}")
        wait_s = self.config.update_wait_s if wait_s is None else float(wait_s)
        deadline = time.monotonic() + wait_s
        while True:
            self.statuses = list(self.engine.collective_rpc("deltasync_status"))
            self.metrics.update(self.statuses)
            self._check_reloads()
            if not self.active:
                raise WeightUpdateRefused(f"update_weights to step {step}: deltasync stopped "
                                          f"following: {self.last_error}")
            done = self._applied_already(step, identity)
            if done is not None:
                return done
            if not ((self.held is not None and self._resync_held()) or self._settle_pending()):
                target = staged_target(self.statuses, step, identity,
                                       after_reset=self.held is not None)
                if target is not None:
                    return self._switch_for_trainer(*target)
            if time.monotonic() >= deadline:
                raise WeightUpdateRefused(self._not_staged(step, identity, wait_s))
            time.sleep(0.05)

    def _applied_already(self, step: int, identity: str | None) -> dict[str, Any] | None:
        """The no-op answer when every rank has ``step`` applied; raise when the applied step
        is newer, or ``step`` with another identity; None otherwise (wait and switch)."""
        applied = {(s.get("applied_step"), s.get("applied_id")) for s in self.statuses}
        if len(applied) != 1 or self.held is not None:
            return None
        (applied_step, applied_id), = applied
        if applied_step is None:
            return None
        if step < applied_step:
            raise WeightUpdateRefused(
                f"update_weights to step {step} refused: this server applied step "
                f"{applied_step}, which is newer (a step older than the applied one never "
                "applies; publish a new step)")
        if step != applied_step:
            return None
        if identity is not None and applied_id is not None and applied_id != identity:
            raise WeightUpdateRefused(
                f"update_weights to step {step} refused: this server applied step {step} of "
                f"another manifest (identity {applied_id}, the trainer's is {identity}): "
                "another writer, or a restarted trainer reusing the step number")
        return {"step": step, "identity": applied_id, "switched": False}

    def _switch_for_trainer(self, step: int, identity: str | None) -> dict[str, Any]:
        try:
            switched = self._switch(step, identity)
        except CommitFailed as exc:  # the switch stands; the commit is sent again at a tick
            logger.warning("deltasync: %s", exc)
            switched = True
        except SwitchFailed as exc:
            raise WeightUpdateRefused(
                f"update_weights to step {step} failed: {exc}; "
                + (f"the engine holds: {self.held}" if self.held is not None
                   else f"every rank took it back, serving version "
                        f"{self.engine.get_weight_version()}")) from exc
        if not switched:
            raise WeightUpdateRefused(
                f"update_weights to step {step} failed: {self.last_error}; "
                + (f"the engine holds: {self.held}" if self.held is not None
                   else f"every rank took it back, serving version "
                        f"{self.engine.get_weight_version()}"))
        record = self.switches[-1] if self.switches else {}
        return {"step": step, "identity": identity, "switched": True,
                "pause_s": record.get("pause_s")}

    def _not_staged(self, step: int, identity: str | None, wait_s: float) -> str:
        ranks = "; ".join(
            f"rank {s.get('rank', i)}: applied={s.get('applied_step')} "
            f"ready={s.get('ready_steps')} newest={s.get('newest_step')} "
            f"error={s.get('last_error')}" for i, s in enumerate(self.statuses))
        which = f" with identity {identity}" if identity is not None else ""
        held = f"; the engine holds: {self.held}" if self.held is not None else ""
        return (f"update_weights to step {step}: step {step}{which} is not staged on every "
                f"rank after {wait_s:g}s (update_wait_s); is it committed to "
                f"{self.config.redacted_url()}?{held} Ranks: {ranks}")

    def _settle_pending(self) -> bool:
        """True when some rank reports a pending switch: the last switch's commit is sent again
        (no switch starts until no rank has one); any other pending switch holds the engine."""
        pending = {s.get("pending_switch") for s in self.statuses} - {None}
        if not pending:
            return False
        if pending == {self._last_switched}:
            step = self._last_switched
            answers = list(self.engine.collective_rpc("deltasync_commit", args=(step,)))
            logger.warning("deltasync: commit of step %s sent again (answers %s)", step, answers)
            return True
        self.last_error = ("ranks " + ", ".join(
            str(s.get("rank", i)) for i, s in enumerate(self.statuses)
            if s.get("pending_switch") is not None)
            + f" hold a pending switch to step(s) {sorted(pending, key=str)} that no switch of this "
              "coordinator left: the weights are unknown")
        self._hold()
        return True

    def _hold(self) -> None:
        """The ranks' weights are not one version: no batch is scheduled (``PAUSED_ALL``,
        first, so that nothing runs on mixed weights whatever fails next), the weight version
        is ``inconsistent``, ``/synced`` answers 503 with the reason, the prefix cache is
        dropped and every rank forgets its applied step, to resync through the newest anchor.

        Released by :meth:`_release_hold` after a switch every rank applied and then reports.
        Until then every tick keeps scheduling paused and sends ``deltasync_reset`` again to
        any rank still reporting an applied step or a pending switch (:meth:`_resync_held`),
        so a reset that did not reach a rank cannot keep the engine held for ever, and no
        switch starts from a step that is not an anchor on every rank."""
        reason = self.last_error or "the ranks' weights are not one version"
        self.held = reason
        self.engine.scheduler.set_pause_state(self._pause.PAUSED_ALL)
        self._drain_since, self._paused_by_us = None, False  # the hold owns the pause now
        logger.error("deltasync: the ranks' weights are not one version; holding all requests "
                     "(weight version 'inconsistent') until every rank applied the newest "
                     "anchor: %s", reason)
        self.holds.append({"at": time.time(), "reason": reason, "released_at": None,
                           "released_step": None})
        self.engine.set_weight_version("inconsistent")
        self._label = None
        self.metrics.coordinator_state(failing=True, error=SwitchHeld(reason))
        try:
            self.engine.reset_prefix_cache(reset_running_requests=True)
            self.engine.collective_rpc("deltasync_reset", args=(reason,))
        except Exception as exc:  # noqa: BLE001 - sent again at the next ticks (_resync_held)
            logger.error("deltasync: resetting the ranks failed (sent again at the next tick): "
                         "%s: %s", type(exc).__name__, exc)

    def _resync_held(self) -> bool:
        """While held: scheduling stays paused; True (no switch this tick) while some rank
        still reports an applied step or a pending switch, which is sent ``deltasync_reset``
        again. Once every rank forgot its step, the next switch starts from an anchor."""
        sched = self.engine.scheduler
        if sched.pause_state != self._pause.PAUSED_ALL:
            sched.set_pause_state(self._pause.PAUSED_ALL)
        stale = [s.get("rank", i) for i, s in enumerate(self.statuses)
                 if s.get("applied_step") is not None or s.get("pending_switch") is not None]
        if not stale:
            return False
        assert self.held is not None
        logger.warning("deltasync: holding; ranks %s still report a step, resetting them", stale)
        self.engine.reset_prefix_cache(reset_running_requests=True)
        self.engine.collective_rpc("deltasync_reset", args=(self.held,))
        return True

    def _release_hold(self, step: int) -> None:
        """A switch to ``step`` applied on every rank while held: resume scheduling once every
        rank reports ``step`` with one identity and no pending switch but the commit's. Else
        stay held (the next ticks reset the ranks and go through an anchor again)."""
        try:
            statuses = list(self.engine.collective_rpc("deltasync_status"))
        except Exception as exc:  # noqa: BLE001 - stay held; the next tick resets the ranks
            logger.error("deltasync: still holding, the ranks' status after the switch to step "
                         "%d could not be read: %s: %s", step, type(exc).__name__, exc)
            return
        applied = {(s.get("applied_step"), s.get("applied_id")) for s in statuses
                   if isinstance(s, Mapping)}
        pending = {s.get("pending_switch") for s in statuses if isinstance(s, Mapping)} - {None}
        if (len(statuses) < len(self.statuses) or len(applied) != 1
                or next(iter(applied))[0] != step or not pending <= {step}):
            logger.error("deltasync: still holding, the ranks report %s after the switch to step "
                         "%d", sorted(applied, key=str), step)
            return
        self.statuses = statuses
        self.engine.reset_prefix_cache(reset_running_requests=True)
        self.engine.scheduler.set_pause_state(self._pause.UNPAUSED)
        logger.warning("deltasync: every rank applied step %d; scheduling resumes (was held: "
                       "%s)", step, self.held)
        self.held = None
        if self.holds:
            self.holds[-1].update(released_at=time.time(), released_step=step)
        self.metrics.coordinator_state(failing=self.failed_ticks >= FAILING_AFTER)

    def observe_admission(self) -> None:
        """A request was added to this engine: record how far behind the bucket it is served
        (from the ranks' last status: the newest step any rank saw, the oldest applied)."""
        newest = [int(n) for s in self.statuses
                  if isinstance(s, Mapping) and isinstance(n := s.get("newest_step"), int)]
        if not newest:
            return
        applied = [s.get("applied_step") for s in self.statuses if isinstance(s, Mapping)]
        known = [a for a in applied if isinstance(a, int)]
        base = min(known) if known and len(known) == len(applied) else -1
        self.metrics.observe_admission(max(newest) - base)

    def engine_status(self) -> EngineStatus:
        """What the engine core knows (``call_utility("deltasync_engine_status")``)."""
        return {
            "active": self.active,
            "weight_version": self.engine.get_weight_version(),
            "switches": list(self.switches),
            "last_error": self.last_error,
            "failed_ticks": self.failed_ticks,
            "failing": self.failed_ticks >= FAILING_AFTER or self.held is not None,
            "held": self.held,
            "holds": list(self.holds),
            "reloads": self._reloads,
            "ranks": [{k: s.get(k) for k in ("rank", "applied_step", "applied_id", "staged_step",
                                             "newest_step", "pending_switch", "last_error",
                                             "reloads")}
                      for s in self.statuses],
            "metrics_port": self.server.port if self.server is not None else None,
            "drafter": self.drafter.status(),
        }


__all__ = ["FAILING_AFTER", "FAIL_APPLY_RPC_ENV", "FAIL_SWITCH_ENV", "SWITCH_EVERY_STEPS_ENV",
           "CommitFailed", "Coordinator", "SwitchFailed", "SwitchHeld", "WeightUpdateRefused",
           "common_after_reset", "common_ready", "common_ready_step", "staged_target"]

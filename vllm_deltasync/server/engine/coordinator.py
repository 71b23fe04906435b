"""The engine-core side of the switch: when every rank has the same step staged, apply it.

Runs on the engine core's busy-loop thread, between two scheduler steps (the extension's
plugin calls :meth:`Coordinator.tick` when the private wake-up it queued is handled). It talks
to the ranks only through ``engine.collective_rpc``, which every worker executes in order with
``execute_model``: an apply broadcast between two steps lands on all ranks between the same two
model steps. No vLLM import here; the engine object and vLLM's ``PauseState`` are passed in.
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
from vllm_deltasync.format.manifest import SCHEMA_VERSION
from vllm_deltasync.server.metrics import MetricsServer, SyncMetrics

logger = logging.getLogger(__name__)

FAILING_AFTER = 3
"""Consecutive failed ticks after which the coordinator reports itself failing (``/synced``
answers 503, ``deltasync_coordinator_failing`` is 1) until a tick succeeds."""

FAIL_SWITCH_ENV = "DELTASYNC_TEST_FAIL_SWITCH"
"""Test-only failpoint, ``"<step>:<ticks>"``: the switch to ``step`` raises after every rank
applied it and before the prefix-cache reset (once per process), then the next ``ticks`` ticks
raise at their start (a fault that persists). Not a setting: never set it in production."""

SWITCH_EVERY_STEPS_ENV = "DELTASYNC_TEST_SWITCH_EVERY_STEPS"
"""Test-only, ``"<n>"``: switches start only from a tick the engine runs after every ``n``
model steps, never from the timer (which keeps reading status and finishing drains), so a
test knows a switch lands inside the batch it is generating. Not a setting."""


class _Failpoint:
    """The parsed :data:`FAIL_SWITCH_ENV`."""

    def __init__(self, spec: str | None) -> None:
        self.step: int | None = None
        self.ticks = 0
        if spec:
            step, _, ticks = spec.partition(":")
            self.step, self.ticks = int(step), int(ticks or 0)

    def at_switch(self, step: int) -> None:
        if self.step is not None and step == self.step:
            self.step = None
            raise RuntimeError(f"failpoint {FAIL_SWITCH_ENV}: switch to step {step} fails "
                               "between the ranks' apply and the prefix-cache reset")

    def at_tick(self) -> None:
        if self.step is None and self.ticks > 0:
            self.ticks -= 1
            raise RuntimeError(f"failpoint {FAIL_SWITCH_ENV}: the tick fails (a persistent fault)")


def common_ready_step(statuses: Sequence[Mapping[str, Any]]) -> int | None:
    """The newest step every rank has staged on top of the same applied step, or None."""
    if not statuses or len({s.get("applied_step") for s in statuses}) != 1:
        return None
    lists = [list(s.get("ready_steps") or ()) for s in statuses]
    common: int | None = None
    for steps in zip(*lists, strict=False):
        if len(set(steps)) != 1:
            break
        common = steps[0]
    return common


class Coordinator:
    """Decides when all ranks switch; resets the prefix cache; sets the weight version."""

    def __init__(self, engine: Any, config: SyncConfig, *, wake: Callable[[], None] | None,
                 pause_states: Any) -> None:
        self.engine = engine
        self.config = config
        self._wake = wake
        self._pause = pause_states
        self.metrics = SyncMetrics(bucket_url=config.url, format_version=SCHEMA_VERSION)
        self.server: MetricsServer | None = None
        self.switches: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
        self.statuses: list[dict[str, Any]] = []
        self._last_error: str | None = None
        self.active = False
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._drain_since: float | None = None
        self._paused_by_us = False
        self._held_after_failure = False
        self.failed_ticks = 0
        """Consecutive ticks that raised (0 after a good one)."""
        self._logged_error: str | None = None
        self._failpoint = _Failpoint(os.environ.get(FAIL_SWITCH_ENV))
        self._switch_every = int(os.environ.get(SWITCH_EVERY_STEPS_ENV) or 0)
        self._model_steps = 0
        self._reloads = 0
        """Reloads behind our back the ranks have reported (``reloads`` in their status)."""
        self._label: str | None = None
        """The weight version this coordinator last set (a step), to tell it from a user's."""
        self._proof_classes: list[str] = []
        self._last_tick = float("-inf")

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
        """
        if not self.active:
            return
        self._last_tick = time.monotonic()
        try:
            self._failpoint.at_tick()
            self._tick(may_switch=from_steps or not self._switch_every
                       or self._drain_since is not None)
        except Exception as exc:  # noqa: BLE001 - never take the engine down
            self._tick_failed(exc)
        else:
            self.failed_ticks = 0
            self.metrics.coordinator_state(failing=False)

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
        failing = self.failed_ticks >= FAILING_AFTER
        self.metrics.coordinator_state(failing=failing, error=exc)
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
        step = common_ready_step(self.statuses)
        if step is None:
            self._release_drain()
            return
        if not may_switch:
            return
        if self.config.in_flight == "drain" and not self._drained():
            return
        self._switch(step)

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
            self.engine.scheduler.set_pause_state(self._pause.UNPAUSED)
            self._paused_by_us = False

    def _switch(self, step: int) -> None:
        """One unit: every rank applies, the prefix cache is reset, the weight version is set,
        every rank commits. If anything after the ranks' apply fails, the switch is taken back
        on every rank (:meth:`_take_back`) and the error propagates to :meth:`tick`."""
        started = time.perf_counter()
        results = list(self.engine.collective_rpc("deltasync_apply", args=(step,)))
        pause_s = time.perf_counter() - started
        failed = [r for r in results if not r.get("ok")]
        if failed:
            self._after_failure(step, failed)
            return
        try:
            self._failpoint.at_switch(step)
            if self.config.reset_prefix_cache:
                self.engine.reset_prefix_cache(reset_running_requests=True)
            self.engine.set_weight_version(str(step))
            self._label = str(step)
        except Exception as exc:
            self._take_back(step, f"step {step}: the engine core failed the switch after the "
                                  f"ranks applied it: {type(exc).__name__}: {exc}")
            raise
        self.engine.collective_rpc("deltasync_commit", args=(step,))
        if self._held_after_failure:
            self.engine.scheduler.set_pause_state(self._pause.UNPAUSED)
            self._held_after_failure = False
        self._release_drain()
        self.metrics.observe_switch(step, pause_s)
        self.last_error = None
        record = {"step": step, "pause_s": pause_s, "at": time.time(),
                  "steps": results[0].get("steps"), "kinds": results[0].get("kinds"),
                  "apply_s": [r.get("apply_s") for r in results],
                  "repack_s": [r.get("repack_s") for r in results],
                  "downloaded_bytes": [r.get("downloaded_bytes") for r in results],
                  "changed": results[0].get("changed"), "numel": results[0].get("numel")}
        self.switches.append(record)
        logger.info("deltasync switched step=%d ranks=%d pause=%.4fs", step, len(results),
                    pause_s)

    def _take_back(self, step: int, reason: str) -> None:
        """Every rank applied ``step`` but the switch cannot complete: every rank reverts it
        before any batch runs, and the version label stays what the weights are again. When
        some rank cannot, hold (:meth:`_hold`)."""
        self.last_error = reason
        back = list(self.engine.collective_rpc("deltasync_revert", args=(step, reason)))
        if back and all(back):
            if self.config.reset_prefix_cache:  # it may have run half-way: start clean
                self.engine.reset_prefix_cache(reset_running_requests=True)
            logger.error("deltasync switch to step %d taken back on every rank; serving "
                         "version %s: %s", step, self.engine.get_weight_version(), reason)
            self._release_drain()
            return
        self.last_error += "; ranks " + ", ".join(
            str(i) for i, ok in enumerate(back) if not ok) + " could not take it back"
        self._hold()

    def _after_failure(self, step: int, failed: list[Mapping[str, Any]]) -> None:
        """Some rank could not apply ``step``: take the switch back on every rank, or hold.

        A rank whose apply fails puts back what it wrote (``reverted``); the ranks that
        succeeded are asked to take their switch back too (``deltasync_revert``). No batch ran
        in between, so when every rank managed it the engine holds the previous step bit for
        bit, prefix cache included, and goes on serving it; the ranks then wait for an anchor
        newer than the failed step. Only when some rank cannot put its weights back (an
        anchor was half written, or the revert failed) is scheduling held until an anchor
        applies everywhere (:meth:`_hold`).
        """
        self.last_error = f"step {step}: " + "; ".join(
            f"rank {r.get('rank')}: {r.get('error')}" for r in failed)
        if all(r.get("reverted") for r in failed):
            back = list(self.engine.collective_rpc("deltasync_revert",
                                                   args=(step, self.last_error)))
            if all(back):
                logger.error("deltasync switch to step %d failed and was taken back on every "
                             "rank; serving version %s until a newer anchor applies: %s", step,
                             self.engine.get_weight_version(), self.last_error)
                self._release_drain()
                return
            self.last_error += "; ranks " + ", ".join(
                str(i) for i, ok in enumerate(back) if not ok) + " could not take it back"
        self._hold()

    def _hold(self) -> None:
        """The ranks' weights are not one version: hold scheduling, resync through an anchor."""
        logger.error("deltasync switch failed, holding requests until an anchor applies: %s",
                     self.last_error)
        self.engine.reset_prefix_cache(reset_running_requests=True)
        self.engine.collective_rpc("deltasync_reset", args=(self.last_error,))
        self.engine.set_weight_version("inconsistent")
        self._label = None
        self.engine.scheduler.set_pause_state(self._pause.PAUSED_ALL)
        self._held_after_failure = True

    def engine_status(self) -> dict[str, Any]:
        """What the engine core knows (``call_utility("deltasync_engine_status")``)."""
        return {
            "active": self.active,
            "weight_version": self.engine.get_weight_version(),
            "switches": list(self.switches),
            "last_error": self.last_error,
            "failed_ticks": self.failed_ticks,
            "failing": self.failed_ticks >= FAILING_AFTER,
            "reloads": self._reloads,
            "ranks": [{k: s.get(k) for k in ("rank", "applied_step", "staged_step",
                                             "newest_step", "last_error", "reloads")}
                      for s in self.statuses],
            "metrics_port": self.server.port if self.server is not None else None,
        }


__all__ = ["FAILING_AFTER", "FAIL_SWITCH_ENV", "SWITCH_EVERY_STEPS_ENV", "Coordinator",
           "common_ready_step"]

"""The engine-core side of following: start every rank, then tick between scheduler steps.

Runs on the engine core's busy-loop thread, between two scheduler steps (the plugin's hook
calls :meth:`Coordinator.tick` when the private wake-up it queued is handled). It talks to the
ranks only through ``engine.collective_rpc``, which every worker executes in order with
``execute_model``: a broadcast between two steps lands on all ranks between the same two model
steps. No vLLM import here: the engine is the typed handle of ``handle.py``.

Each tick reads every rank's status (parsed once, ``server/messages.py``), feeds the metrics,
notices weights written behind our back, and hands each followed target's statuses to its
:class:`~.follower.TargetFollower` (one per row of ``server/targets.py``, in switch order),
which switches it when every rank has a common step staged (``follower.py``, ``switch.py``).
The scheduling pause (hold, drain) is ``gate.py``'s. A target whose failures hold the engine
(the policy) makes a tick fail when its switch fails; another target's failure is reported on
its own (its follower's report, its metrics) and never fails the tick.

The ranks' switch RPCs never raise on purpose (they answer the failure): vLLM's multiprocessing
executor stops reading answers at the first rank whose RPC raised, and the later ranks' answers
would then be read by the next broadcast. Answers are parsed and checked for their rank, so a
misplaced answer counts as a failure, never as a success.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from vllm_deltasync import failpoints
from vllm_deltasync._urls import redact_text
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.format.manifest import SCHEMA_VERSION
from vllm_deltasync.server.endpoint import MetricsServer
from vllm_deltasync.server.engine.follower import TargetFollower
from vllm_deltasync.server.engine.gate import Gate
from vllm_deltasync.server.engine.handle import EngineCore
from vllm_deltasync.server.engine.kv import KvVersions, Requests, unknown_identity
from vllm_deltasync.server.engine.switch import Failpoint, SwitchHeld, fatal
from vllm_deltasync.server.messages import EngineStatus, RankStatus, TargetStatus
from vllm_deltasync.server.metrics import SyncMetrics
from vllm_deltasync.server.targets import TARGETS, Target, switch_order, targets_for

logger = logging.getLogger(__name__)

FAILING_AFTER = 3
"""Consecutive failed ticks after which the coordinator reports itself failing (``/synced``
answers 503, ``deltasync_coordinator_failing`` is 1) until a tick succeeds."""

PRIMARY = TARGETS[0].name
OTHERS = tuple(t.name for t in TARGETS[1:])


def parse_statuses(raw: Any, others: tuple[str, ...] = OTHERS) -> list[RankStatus]:
    """Every rank's ``deltasync_status`` answer, parsed (``MessageError`` if one is not);
    ``others``: the names of the server's targets beside the primary one."""
    return [RankStatus.from_wire(r, primary=PRIMARY, others=others) for r in raw]


class Coordinator:
    """Starts the ranks, ticks, and owns what is engine-wide (module doc)."""

    def __init__(self, engine: EngineCore, config: SyncConfig, *,
                 wake: Callable[[], None] | None, trainer_driven: bool = False,
                 requests: Requests | None = None) -> None:
        """``requests``: the engine core's requests (``server/vllm/scheduler.py``), salted by
        the weights they run on (``kv.py``); None: nothing is salted (engine-less tests)."""
        self.engine = engine
        self.config = config
        self.kv = KvVersions(requests, [t.name for t in TARGETS if t.policy.kv_scope == "every"])
        self.trainer_driven = trainer_driven
        """vLLM's weight-transfer API with backend ``deltasync``: the ranks' pollers stage steps
        as usual, but only the trainer's ``update_weights`` switches the targets it drives
        (``trainer.py``); a tick switches them only to release a hold."""
        self._wake = wake
        self.metrics = SyncMetrics(bucket_url=config.url, format_version=SCHEMA_VERSION)
        self.server: MetricsServer | None = None
        self.gate = Gate(engine, config.max_drain_wait_s)
        self.failpoint = Failpoint()
        self.rows: tuple[Target, ...] = targets_for(config)
        """The server's target table (``server/targets.py``): the policy, the drafter, then
        each LoRA adapter of ``lora_urls``."""
        self._others = tuple(t.name for t in self.rows[1:])
        self.followers = {t.name: TargetFollower(engine, config, t, self.gate, self.failpoint,
                                                 self.metrics, self.read_statuses, self.kv)
                          for t in switch_order(self.rows)}
        self.ranks: list[RankStatus] = []
        self._last_error: str | None = None
        self.active = False
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self.failed_ticks = 0
        """Consecutive ticks that raised (0 after a good one)."""
        self._logged_error: str | None = None
        every = failpoints.armed("switch_every_steps")
        self._switch_every = int(every[0][0]) if every else 0
        self._model_steps = 0
        self._reloads = 0
        """Reloads behind our back the ranks have reported (``reloads`` in their status)."""
        self._proof_classes: list[str] = []
        self._last_tick = float("-inf")

    @property
    def primary(self) -> TargetFollower:
        return self.followers[PRIMARY]

    @property
    def statuses(self) -> list[TargetStatus]:
        """The primary target's status of every rank, from the last read."""
        return [r.targets[PRIMARY] for r in self.ranks]

    @property
    def held(self) -> str | None:
        """Why scheduling is held, None when it is not."""
        return next((f.held for f in self.followers.values()
                     if f.policy.holds_engine and f.held is not None), None)

    @property
    def last_error(self) -> str | None:
        """The last failure, URLs and secrets redacted (served by ``/synced`` and the status)."""
        return self._last_error or self.primary.last_error

    @last_error.setter
    def last_error(self, text: str | None) -> None:
        self._last_error = None if text is None else redact_text(text)

    def read_statuses(self) -> list[RankStatus]:
        return self.parse(self.engine.collective_rpc("deltasync_status"))

    def parse(self, raw: Any) -> list[RankStatus]:
        """Every rank's status answer, with this server's targets."""
        return parse_statuses(raw, self._others)

    # ----------------------------------------------------------------- lifecycle
    def start(self, refuse: str | None = None) -> None:
        """Prove every rank (``deltasync_start``, then the collective ``deltasync_prove``),
        start the metrics endpoint, then the pollers (``deltasync_follow``) and the wake-up
        timer (none when ``wake`` is None: the in-process engine core ticks from its client).
        If any rank refuses, no rank follows (``deltasync_stop``); the engine serves its
        checkpoint, and ``/metrics`` and ``/synced`` (503) say why. ``refuse``: a reason known
        before any rank is asked: the same refusal, without starting any rank."""
        if refuse is not None:
            self.last_error = refuse
            self._start_metrics()
            self._refuse(refuse)
            return
        try:
            self.ranks = self.parse(self.engine.collective_rpc("deltasync_start"))
            if not self._refused():
                self._proof_classes = sorted({c for s in self.statuses for c in s.proof_classes})
                self.ranks = self.parse(self.engine.collective_rpc(
                    "deltasync_prove", args=(self._proof_classes,)))
        except Exception as exc:  # noqa: BLE001 - the server keeps serving its checkpoint
            self.last_error = f"{type(exc).__name__}: {exc}"
        else:
            self.last_error = self._refused()
        self._start_metrics()
        if self.last_error is not None:
            self._refuse(self.last_error)
            return
        self.ranks = self.parse(self.engine.collective_rpc("deltasync_follow"))
        self.active = True
        if self._wake is not None:
            self._timer = threading.Thread(target=self._run_timer, name="deltasync-wake",
                                           daemon=True)
            self._timer.start()
        logger.info("deltasync following %s with %d rank(s), poll every %.2fs",
                    self.config.redacted_url(), len(self.ranks), self.config.poll_interval_s)
        if not self.config.reset_prefix_cache:
            logger.warning("deltasync: reset_prefix_cache=false is deprecated: requests are "
                           "salted by the weights they run on, no switch drops the prefix "
                           "cache; running requests keep their KV (set in_flight=keep_kv, the "
                           "default, and drop reset_prefix_cache)")

    def _refused(self) -> str | None:
        reasons = [f"rank {s.rank}: {s.refused}" for s in self.statuses if s.refused]
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
            self.ranks = self.parse(s for s in stopped if s is not None) or self.ranks
        except Exception as exc:  # noqa: BLE001 - still report the refusal
            logger.error("deltasync could not stop every rank: %s", exc)
        if not self.ranks:
            self.ranks = [RankStatus({PRIMARY: TargetStatus(rank=0, model=PRIMARY,
                                                            last_error=reason)}, PRIMARY)]
        self.metrics.update(self.ranks)
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
        While the engine holds it reports itself failing whatever the ticks do."""
        if not self.active:
            return
        self._last_tick = time.monotonic()
        try:
            self.failpoint.at_tick()
            self._tick(may_switch=from_steps or not self._switch_every or self.gate.draining)
        except BaseException as exc:  # noqa: BLE001 - never take the engine down
            if fatal(exc):
                raise
            self._tick_failed(exc)
        else:
            self.failed_ticks = 0
            self._last_error = None
            self.metrics.coordinator_state(failing=self.held is not None)

    def tick_if_due(self) -> None:
        """A tick, unless one ran less than ``poll_interval_s`` ago (the in-process engine
        core, which has no busy loop and no wake-up timer, calls this before each step)."""
        if time.monotonic() - self._last_tick >= self.config.poll_interval_s:
            self.tick()

    def after_model_step(self) -> None:
        """After a model step ran (test failpoint ``switch_every_steps``: the test plugin of
        tests/engine calls it)."""
        if not self._switch_every:
            return
        self._model_steps += 1
        if self._model_steps >= self._switch_every:
            self._model_steps = 0
            self.tick(from_steps=True)

    def after_utility(self) -> None:
        """Right after a client's utility call that may have written the weights
        (``collective_rpc("reload_weights")``) and before the next batch: a tick notices a
        reload before any request is served under the old label."""
        self.tick()

    def _tick_failed(self, exc: BaseException) -> None:
        self.failed_ticks += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        held = self.held
        failing = self.failed_ticks >= FAILING_AFTER or held is not None
        error = exc if held is None else SwitchHeld(
            f"{held}; a tick failed while holding: {self.last_error}")
        self.metrics.coordinator_state(failing=failing, error=error)
        if self.last_error != self._logged_error:
            self._logged_error = self.last_error
            trace = redact_text("".join(traceback.format_exception(exc)))
            logger.error("deltasync tick failed (%d in a row; this error is logged once): %s\n%s",
                         self.failed_ticks, self.last_error, trace)

    def _tick(self, *, may_switch: bool) -> None:
        self.ranks = self.read_statuses()
        self.metrics.update(self.ranks)
        self.check_reloads()
        if not self.active:
            return
        failed: BaseException | None = None
        for name, follower in self.followers.items():
            statuses = [s for r in self.ranks if (s := r.of(name)) is not None]
            try:
                follower.tick(statuses if len(statuses) == len(self.ranks) else [],
                              may_switch=may_switch, trainer_driven=self.trainer_driven)
            except Exception as exc:
                if follower.policy.holds_engine:
                    failed = failed or exc
                else:  # reported on its own (its report, its metrics); the tick goes on
                    logger.error("deltasync %s: %s: %s", name, type(exc).__name__, exc)
        if failed is not None:
            raise failed

    def check_reloads(self) -> None:
        """A rank saw its weights written behind our back (vLLM's ``reload_weights``): it
        forgot its applied step and resyncs through the newest anchor. Until that anchor's
        switch the weights are whatever was loaded, so the step label is withdrawn
        (``unknown``; a label the user set after the reload is left alone), the requests are
        salted by an identity no other weights share and the running ones compute their KV
        again (``kv.py``; the prefix cache is also dropped unless ``reset_prefix_cache`` is
        false), and the rebuilt maps are proved again."""
        reloads = sum(s.reloads for s in self.statuses)
        if reloads <= self._reloads:
            return
        self._reloads = reloads
        for target in TARGETS:  # unknown weights: no request may share blocks with any other
            if target.policy.kv_scope == "every":
                self.kv.switched(target.name, unknown_identity(target.name), "continue")
        if self.config.reset_prefix_cache:
            self.engine.reset_prefix_cache(reset_running_requests=True)
        label = self.engine.get_weight_version()
        if self.primary.label is not None and label == self.primary.label:
            self.engine.set_weight_version("unknown")
            self.primary.label = None
        logger.warning("deltasync: the weights were reloaded outside deltasync (weight version "
                       "was %s, now %s); proving the rebuilt map again, then resyncing through "
                       "the newest anchor", label, self.engine.get_weight_version())
        self.ranks = self.parse(self.engine.collective_rpc(
            "deltasync_prove", args=(self._proof_classes,), kwargs={"again": True}))
        reason = self._refused()
        if reason is not None:
            self.last_error = f"after a reload: {reason}"
            self._refuse(self.last_error)
            self.active = False

    # ------------------------------------------------------ trainer-driven (weight transfer)
    def update_to(self, step: Any, identity: Any = None, *,
                  wait_s: float | None = None) -> dict[str, Any]:
        """The trainer's ``update_weights({"step": N, "identity": ...})`` (``trainer.py``)."""
        from vllm_deltasync.server.engine.trainer import update_to

        return update_to(self, step, identity, wait_s=wait_s)

    # ------------------------------------------------------------------- requests
    def admit(self, request: Any) -> None:
        """Before the engine core adds ``request`` (busy-loop thread, or the in-process
        caller's): its prefix-cache salt by the weights applied now (``kv.py``). Never
        raises: a failure is logged and kept as the last error."""
        try:
            self.kv.admit(request)
        except Exception as exc:  # noqa: BLE001 - never take the engine down
            error = f"prefix-cache salt: {type(exc).__name__}: {exc}"
            if error != self._last_error:
                logger.error("deltasync: a request could not be salted by the applied weights "
                             "(it may reuse KV blocks of other weights): %s", error)
            self.last_error = error

    # ------------------------------------------------------------------- reading
    def observe_admission(self) -> None:
        """A request was added to this engine: record how far behind the bucket it is served
        (from the ranks' last status: the newest step any rank saw, the oldest applied)."""
        statuses = self.statuses
        newest = [s.newest_step for s in statuses if s.newest_step is not None]
        if not newest:
            return
        known = [s.applied_step for s in statuses if s.applied_step is not None]
        base = min(known) if known and len(known) == len(statuses) else -1
        self.metrics.observe_admission(max(newest) - base)

    def engine_status(self) -> dict[str, Any]:
        """What the engine core knows (``call_utility("deltasync_engine_status")``)."""
        reports = {name: r for name, f in self.followers.items()
                   if (r := f.report()) is not None}
        status = EngineStatus(
            active=self.active, weight_version=self.engine.get_weight_version(),
            last_error=self.last_error, failed_ticks=self.failed_ticks,
            failing=self.failed_ticks >= FAILING_AFTER or self.held is not None,
            reloads=self._reloads,
            metrics_port=self.server.port if self.server is not None else None,
            targets=reports, primary=PRIMARY)
        return status.to_wire([t.name for t in self.rows])

    # ------------------------------------------------------------------ LoRA adapters
    def lora_versions(self) -> dict[str, Any]:
        """Each followed adapter's versions requests may use on this engine, and why it does
        not follow (``deltasync_lora_versions``, read by the API server: server/vllm/http.py)."""
        out: dict[str, Any] = {}
        for name, f in self.followers.items():
            if f.versions is not None:
                statuses = [s for r in self.ranks if (s := r.of(name)) is not None]
                out[name] = f.versions.report(statuses)
        return out

    def admits_adapter(self, adapter: int) -> str | None:
        """Why a request naming vLLM adapter id ``adapter`` may not be added, or None: one of
        our versions' ids that no followed adapter may serve now (retired, retiring, or a
        name the API did not resolve). Any other id (the user's own adapters) is vLLM's."""
        from vllm_deltasync.server.engine.versions import is_ours

        if not is_ours(adapter):
            return None
        kept = []
        for name, f in self.followers.items():
            if f.versions is None:
                continue
            if f.versions.admits(adapter):
                return None
            kept += [f"{name}@{v.step}" for v in f.versions.servable()]
        return (f"adapter version id {adapter} is not kept on this engine (kept: "
                f"{', '.join(kept) or 'none'}); the request is failed")


__all__ = ["FAILING_AFTER", "Coordinator", "parse_statuses"]

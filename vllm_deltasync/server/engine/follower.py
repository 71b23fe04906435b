"""The engine core's side of one followed target: when to switch it, and what a failed switch
means for it.

One :class:`TargetFollower` per row of the target table (``server/targets.py``), all the same
class: the row's :class:`~vllm_deltasync.server.targets.SwitchPolicy` says what differs. At
each tick the coordinator hands it the ranks' statuses of its target; it switches when every
rank has a common step staged (``ready.py``), through one :class:`~.switch.Switch`, and acts
on the result:

- the switch stands: the label (``labels_version``), the record, the metrics;
- taken back on every rank: the target keeps its weights until a newer anchor;
- some rank's weights are unknown: the target is *held*: every rank forgets its step and
  resyncs through the newest anchor; a target that ``holds_engine`` also stops scheduling
  (``gate.py``) and labels the weights ``inconsistent`` until a switch every rank applied and
  then reports releases it. Any other target keeps serving meanwhile (the drafter: the
  output's distribution is the target model's whatever the draft);
- the commit did not reach every rank: the switch stands and the commit is sent again while
  a rank reports it pending (no switch starts meanwhile); a pending switch the follower did
  not leave holds the target (someone called ``deltasync_apply`` by hand).

A target whose steps are versions kept side by side (``SwitchPolicy.versions_kept``: a LoRA
adapter) also has its :class:`~.versions.KeptVersions`: at each tick older versions no request
uses are removed, and a switch waits while it would keep more than ``versions_kept``.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm_deltasync._urls import redact_text
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.server.engine.gate import Gate
from vllm_deltasync.server.engine.handle import EngineCore
from vllm_deltasync.server.engine.kv import KvVersions
from vllm_deltasync.server.engine.ready import common_ready
from vllm_deltasync.server.engine.switch import CommitFailed, Failpoint, Switch
from vllm_deltasync.server.engine.versions import KeptVersions
from vllm_deltasync.server.messages import RankStatus, SwitchRecord, TargetReport, TargetStatus
from vllm_deltasync.server.targets import Target

logger = logging.getLogger(__name__)

STAGED_TICKS = 10
"""Ticks a staged step may wait for its switch, the ranks' staged and applied steps unchanged,
before :meth:`TargetFollower.watch_staged` logs every rank's status once."""

SWITCH_BOUND_TICKS = 1
"""The bound (issue 34): a step staged on every rank is switched at the first tick that sees it
(0 ticks of waiting), busy engine or not, unless the engine drains, holds, is driven by the
trainer or resends a commit; a wait past this bound is logged with its cause and reported
(``max_wait_ticks`` in the engine status), and the engine tests fail on it."""

INCONSISTENT = "inconsistent"
"""vLLM's weight version while the ranks' weights are not one step."""


class TargetFollower:
    """One target on the engine core (module doc)."""

    def __init__(self, engine: EngineCore, config: SyncConfig, target: Target, gate: Gate,
                 failpoint: Failpoint, metrics: Any,
                 read: Callable[[], Sequence[RankStatus]], kv: KvVersions) -> None:
        """``read``: every rank's status read now (the coordinator's parse); ``kv``: the
        engine's request salts (``kv.py``)."""
        self.engine, self.config, self.target, self.kv = engine, config, target, kv
        self._read = read
        self.name = target.name
        self.policy = target.policy
        self.gate, self.failpoint, self.metrics = gate, failpoint, metrics
        self.statuses: list[TargetStatus] = []
        self.switches: collections.deque[SwitchRecord] = collections.deque(maxlen=256)
        self.holds: collections.deque[dict[str, Any]] = collections.deque(maxlen=64)
        self.held: str | None = None
        """Why this target's ranks resync through an anchor (see the module doc)."""
        self.failures = 0
        self._last_error: str | None = None
        self.last_switched: int | None = None
        """The step of the last switch that stands (its commit may still be pending)."""
        self.label: str | None = None
        """The weight version this follower last set (``labels_version``)."""
        self._staged: tuple[tuple[Any, ...], int, bool] | None = None
        self.ticks = 0
        """Ticks this follower ran."""
        self._due: tuple[int, int] | None = None
        """(step, tick) of the newest step every rank has staged, from the first tick that saw
        it staged everywhere until its switch."""
        self.max_wait_ticks = 0
        """The longest a step staged on every rank waited for its switch, in ticks."""
        self.versions = (KeptVersions(engine, target)
                         if target.policy.versions_kept is not None else None)
        """Versions kept side by side (``versions.py``), None for weights written in place."""

    @property
    def last_error(self) -> str | None:
        return self._last_error

    @last_error.setter
    def last_error(self, text: str | None) -> None:
        self._last_error = None if text is None else redact_text(text)

    @property
    def follows(self) -> bool:
        """Every rank reports this target and none refused it."""
        return bool(self.statuses) and not any(s.refused for s in self.statuses)

    def tick(self, statuses: Sequence[TargetStatus], *, may_switch: bool,
             trainer_driven: bool) -> None:
        """Between two scheduler steps: switch when every rank has a common step staged."""
        self.statuses = list(statuses)
        self.ticks += 1
        if not self.follows:
            return
        if self.versions is not None:
            self.statuses = self.versions.tick(self.statuses) or self.statuses
        self.watch_staged(trainer_driven)
        if self.held is not None and self.resync_held():
            return
        if self.settle_pending():
            return
        found = common_ready(self.statuses)
        if found is None:
            if self.policy.drains:
                self.gate.release_drain()
            return
        if self._due is None:
            self._due = (found[0], self.ticks)
        if not may_switch or (trainer_driven and self.policy.trainer_driven
                              and self.held is None):
            self._due = None  # switched on another schedule: not a wait of ours
            return
        if self.policy.drains and self.config.in_flight == "drain" and not self.gate.drained():
            return
        if self.versions is not None and not self.versions.room():
            self._due = None  # waits for requests on an older version, not for the engine
            return
        self.switch(*found)

    def switch(self, step: int, identity: str | None = None) -> bool:
        """One :class:`Switch`, then what outlives it (module doc). True when the switch
        stands (a :class:`CommitFailed` raised after it says the same), False when taken back;
        a :class:`~.switch.SwitchFailed` is raised after acting on it."""
        out = Switch(self.engine, self.config, self.target, len(self.statuses),
                     self.failpoint, self.kv).run(step, identity)
        if not out.switched:
            self.failures += 1
            self.last_error = out.reason
            if out.unknown:
                self.hold()
            elif self.policy.drains:
                self.gate.release_drain()
            if out.error is not None:
                raise out.error
            return False
        if self.policy.labels_version:
            self.label = str(step)
            self.metrics.observe_switch(step, out.pause_s)
        self.last_switched = step
        if self.versions is not None:
            self.versions.switched(step, identity)
        self._waited()
        if self.held is not None:
            self._release_hold(step)
        if self.policy.drains:
            self.gate.release_drain()
        self.last_error = None
        if out.record is not None:
            self.switches.append(out.record)
        logger.info("deltasync %s switched step=%d ranks=%d pause=%.4fs", self.name, step,
                    len(self.statuses), out.pause_s)
        if out.commit_error is not None:
            raise CommitFailed(out.commit_error)
        return True

    def _waited(self) -> None:
        """A switch stood: how long its step waited staged on every rank (the bound)."""
        if self._due is None:
            return
        wait = self.ticks - self._due[1]
        self._due = None
        self.max_wait_ticks = max(self.max_wait_ticks, wait)
        if wait > SWITCH_BOUND_TICKS:
            logger.warning("deltasync %s: a step staged on every rank waited %d ticks for its "
                           "switch (bound %d): held=%s draining=%s", self.name, wait,
                           SWITCH_BOUND_TICKS, self.held, self.gate.draining)

    def settle_pending(self) -> bool:
        """True when some rank reports a pending switch: the last switch's commit is sent again
        (no switch starts until no rank has one); any other pending switch holds the target."""
        pending = {s.pending_switch for s in self.statuses} - {None}
        if not pending:
            return False
        if pending == {self.last_switched}:
            step = self.last_switched
            answers = list(self.engine.collective_rpc("deltasync_commit", args=(step,),
                                                      kwargs={"model": self.name}))
            logger.warning("deltasync %s: commit of step %s sent again (answers %s)", self.name,
                           step, answers)
            return True
        self.last_error = ("ranks " + ", ".join(
            str(s.rank) for s in self.statuses if s.pending_switch is not None)
            + f" hold a pending {self.name} switch to step(s) {sorted(pending, key=str)} that no "
              "switch of this engine core left: the weights are unknown")
        self.hold()
        return True

    def hold(self) -> None:
        """The ranks' weights of this target are not one version: every rank forgets its step
        and resyncs through the newest anchor; a target that ``holds_engine`` also stops
        scheduling first and labels the weights ``inconsistent``. Released by a switch every
        rank applied and then reports (:meth:`_release_hold`); until then every tick sends
        ``deltasync_reset`` again to a rank still reporting a step (:meth:`resync_held`)."""
        reason = self.last_error or f"the ranks' {self.name} weights are not one version"
        self.held = reason
        if self.policy.holds_engine:
            self.gate.hold(self.name)
            logger.error("deltasync: the ranks' %s weights are not one version; holding all "
                         "requests until every rank applied the newest anchor: %s", self.name,
                         reason)
        else:
            logger.error("deltasync: the ranks' %s weights are not one version; it resyncs "
                         "through the newest anchor while the engine serves: %s", self.name,
                         reason)
        self.holds.append({"at": time.time(), "reason": reason, "released_at": None,
                           "released_step": None})
        if self.policy.labels_version:
            self.engine.set_weight_version(INCONSISTENT)
            self.label = None
        try:
            self._reset_ranks(reason)
        except Exception as exc:  # noqa: BLE001 - sent again at the next ticks (resync_held)
            logger.error("deltasync: resetting the ranks' %s failed (sent again at the next "
                         "tick): %s: %s", self.name, type(exc).__name__, exc)

    def _reset_ranks(self, reason: str) -> None:
        if self.policy.resets_prefix_cache:
            self.engine.reset_prefix_cache(reset_running_requests=True)
        self.engine.collective_rpc("deltasync_reset", args=(reason,), kwargs={"model": self.name})

    def resync_held(self) -> bool:
        """While held: True (no switch this tick) while some rank still reports an applied
        step or a pending switch, which is sent ``deltasync_reset`` again."""
        if self.policy.holds_engine:
            self.gate.keep_held()
        stale = [s.rank for s in self.statuses
                 if s.applied_step is not None or s.pending_switch is not None]
        if not stale:
            return False
        assert self.held is not None
        logger.warning("deltasync: %s held; ranks %s still report a step, resetting them",
                       self.name, stale)
        self._reset_ranks(self.held)
        return True

    def _release_hold(self, step: int) -> None:
        """A switch to ``step`` applied on every rank while held: released once every rank
        reports ``step`` with one identity and no pending switch but the commit's."""
        try:
            statuses = [r.of(self.name) for r in self._read()]
        except Exception as exc:  # noqa: BLE001 - stay held; the next tick resets the ranks
            logger.error("deltasync: %s still held, the ranks' status after the switch to step "
                         "%d could not be read: %s: %s", self.name, step, type(exc).__name__, exc)
            return
        mine = [s for s in statuses if s is not None]
        applied = {s.applied for s in mine}
        pending = {s.pending_switch for s in mine} - {None}
        if (len(mine) < len(self.statuses) or len(applied) != 1
                or next(iter(applied))[0] != step or not pending <= {step}):
            logger.error("deltasync: %s still held, the ranks report %s after the switch to "
                         "step %d", self.name, sorted(applied, key=str), step)
            return
        self.statuses = mine
        if self.policy.holds_engine:
            if self.policy.resets_prefix_cache:
                self.engine.reset_prefix_cache(reset_running_requests=True)
            self.gate.release(self.name)
        logger.warning("deltasync: every rank applied %s step %d; released (was held: %s)",
                       self.name, step, self.held)
        self.held = None
        if self.holds:
            self.holds[-1].update(released_at=time.time(), released_step=step)

    def watch_staged(self, trainer_driven: bool) -> None:
        """A step staged on some rank that is not switched for :data:`STAGED_TICKS` ticks in a
        row (the ranks' staged and applied steps unchanged) is logged once, with every rank's
        status and why the follower waits."""
        key = tuple((s.rank, s.applied_step, s.ready_steps) for s in self.statuses)
        if not any(ready for _, _, ready in key):
            self._staged = None
            return
        if self._staged is None or self._staged[0] != key:
            self._staged = (key, 1, False)
            return
        _, ticks, logged = self._staged
        ticks += 1
        self._staged = (key, ticks, logged or ticks >= STAGED_TICKS)
        if logged or ticks < STAGED_TICKS:
            return
        why = ("held: " + self.held if self.held is not None
               else "trainer-driven: waiting for the trainer's update_weights"
               if trainer_driven and self.policy.trainer_driven
               else "draining" if self.policy.drains and self.gate.draining
               else "no step staged on every rank" if common_ready(self.statuses) is None
               else "a switch is due")
        ranks = "; ".join(
            f"rank {s.rank}: applied={s.applied_step} ready={list(s.ready_steps)} "
            f"staged={s.staged_step} newest={s.newest_step} pending={s.pending_switch} "
            f"error={s.last_error}" for s in self.statuses)
        logger.warning("deltasync %s: a staged step has not been switched for %d ticks (%s); %s",
                       self.name, ticks, why, ranks)

    def report(self) -> TargetReport | None:
        """For the engine status; None when no rank follows this target."""
        if not self.statuses:
            return None
        return TargetReport(
            versions=(() if self.versions is None
                      else tuple((v.step, v.adapter) for v in self.versions.servable())),
            switches=tuple(self.switches), failures=self.failures, last_error=self.last_error,
            max_wait_ticks=self.max_wait_ticks, ticks=self.ticks,
            held=self.held, holds=tuple(dict(h) for h in self.holds),
            ranks=tuple({"rank": s.rank, "applied_step": s.applied_step,
                         "applied_id": s.applied_id, "staged_step": s.staged_step,
                         "newest_step": s.newest_step, "pending_switch": s.pending_switch,
                         "last_error": s.last_error, "reloads": s.reloads, "refused": s.refused}
                        for s in self.statuses))


__all__ = ["INCONSISTENT", "STAGED_TICKS", "TargetFollower"]

"""One switch of one target, as one unit: every rank applies a step, the engine core does what
the target's policy asks (the requests' KV by ``in_flight`` and the prefix-cache salt,
``kv.py``; the weight version), every rank commits; anything that fails on the way is taken
back on every rank, or the result says the ranks' weights are unknown.

:class:`Switch` is the engine-core half of the switch protocol, the same for every target
(``server/targets.py``); its rank half is ``server/worker/switching.py``, answering through the
``deltasync_*`` RPCs with the typed messages of ``server/messages.py``. The follower of the
target (``follower.py``) owns what outlives one switch (the label, the hold, the records) and
acts on the :class:`SwitchResult`.

Anything that fails between the first ``deltasync_apply`` reaching a rank and the commit:

* some rank answers a failure: taken back on every rank, unless some rank answered
  ``unknown`` (it could not put its weights back): then ``unknown``;
* the apply broadcast itself raises (an RPC timeout, a rank whose RPC raised): nobody knows
  which ranks wrote, so every rank is asked to revert, and each decides from what it did
  (``put_back``, ``nothing_written``, or ``unknown``). The result carries a
  :class:`SwitchFailed` to raise (a failed tick);
* the engine core's own steps raise: the same revert, and the same error.

The commit only drops the ranks' undo, after the weights (and the label) are the new step: if
it fails the switch stands (``commit_error``; the follower sends it again at the next ticks).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from vllm_deltasync import failpoints
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import DeltaSyncError
from vllm_deltasync.server.engine.handle import EngineCore
from vllm_deltasync.server.engine.kv import KvSwitch, KvVersions, unknown_identity
from vllm_deltasync.server.messages import (
    ApplyAnswer,
    CommitAnswer,
    CommitOutcome,
    Outcome,
    RevertAnswer,
    SwitchRecord,
)
from vllm_deltasync.server.targets import Target

logger = logging.getLogger(__name__)


class SwitchHeld(RuntimeError):
    """Why the engine holds scheduling (``/synced`` and the coordinator failure counter)."""


class SwitchFailed(RuntimeError):
    """A switch failed in the engine core or its apply broadcast (taken back, or held)."""


class CommitFailed(RuntimeError):
    """The commit broadcast of a switch that stands failed (retried at the next tick)."""


def fatal(exc: BaseException) -> bool:
    """The engine core is going down (signal, interpreter exit): nothing more to send."""
    return isinstance(exc, (KeyboardInterrupt, SystemExit))


class Failpoint:
    """Test-only ``switch=<model>/<step>/<ticks>`` (``failpoints.py``)."""

    def __init__(self) -> None:
        armed = failpoints.armed("switch")
        self.model, self.step, self.ticks = (None, None, 0)
        if armed:
            model, step, *ticks = armed[0]
            self.model, self.step, self.ticks = model, int(step), int(ticks[0]) if ticks else 0

    def at_switch(self, model: str, step: int) -> None:
        if self.step is not None and (model, step) == (self.model, self.step):
            self.step = None
            raise RuntimeError(f"failpoint switch: the {model}'s switch to step {step} fails "
                               "between the ranks' apply and the engine core's part")

    def at_tick(self) -> None:
        if self.step is None and self.ticks > 0:
            self.ticks -= 1
            raise RuntimeError("failpoint switch: the tick fails (a persistent fault)")


@dataclasses.dataclass
class SwitchResult:
    """What a :class:`Switch` did."""

    step: int
    switched: bool
    """Every rank applied the step and the engine core did its part (the switch stands)."""
    reason: str | None = None
    """Why it did not switch (taken back, or the weights are unknown)."""
    unknown: bool = False
    """Some rank cannot say which weights it holds, or the revert broadcast failed."""
    error: SwitchFailed | None = None
    """To raise once the follower acted (the apply broadcast or the engine core failed)."""
    pause_s: float = 0.0
    record: SwitchRecord | None = None
    commit_error: str | None = None
    """The commit broadcast failed: the switch stands, the commit is sent again."""


class Switch:
    """The switch of ``target`` on ``engine`` (an ``EngineHandle``) to one step; ``ranks``:
    how many ranks answer. :meth:`run` never leaves the ranks on two versions without saying
    so."""

    def __init__(self, engine: EngineCore, config: SyncConfig, target: Target, ranks: int,
                 failpoint: Failpoint, kv: KvVersions) -> None:
        self.engine = engine
        self.config = config
        self.target = target
        self.ranks = ranks
        self.failpoint = failpoint
        self.kv = kv
        self.kwargs = {"model": target.name}
        self.kv_key = None if target.policy.kv_scope == "none" else target.name
        """The key of its identity among the requests' (``kv.py``); None: it salts nobody."""
        self._kv_before: tuple[str | None] | None = None
        """The identity before the engine part changed it (to restore on a take-back)."""
        self._kv_done: KvSwitch | None = None

    def run(self, step: int, identity: str | None = None) -> SwitchResult:
        started = time.perf_counter()
        try:
            raw = list(self.engine.collective_rpc("deltasync_apply", args=(step, identity),
                                                  kwargs=self.kwargs))
        except BaseException as exc:
            return self._raised(step, "the apply broadcast failed, so no rank is known to have "
                                "applied it or not", exc)
        pause_s = time.perf_counter() - started
        answers = [self._parse(ApplyAnswer.from_wire, raw, i, step) for i in range(self.ranks)]
        failed = [a for a in answers if not a.ok]
        if failed:
            return self.take_back(step, f"step {step}: " + "; ".join(
                f"rank {a.rank}: {a.outcome.value}: {a.error}" for a in failed),
                unknown=any(a.outcome is Outcome.UNKNOWN for a in failed))
        try:
            self.failpoint.at_switch(self.target.name, step)
            self._engine_part(step, identity)
        except BaseException as exc:
            return self._raised(step, "the engine core failed the switch after the ranks "
                                "applied it", exc)
        return SwitchResult(step, switched=True, pause_s=pause_s,
                            record=self._record(step, identity, pause_s, answers),
                            commit_error=self.commit(step))

    def _engine_part(self, step: int, identity: str | None) -> None:
        """The requests' KV (``kv.py``: salts, and the running requests by ``in_flight``),
        then the weight version. No prefix-cache reset: the salt keeps every request off
        blocks of other weights."""
        if self.kv_key is not None:
            self._kv_before = (self.kv.identities.get(self.kv_key),)
            in_flight = self.config.in_flight if self.config.reset_prefix_cache else "keep_kv"
            self._kv_done = self.kv.switched(self.kv_key, identity or unknown_identity(
                self.kv_key), in_flight)  # reset_prefix_cache=false (deprecated): keep_kv
        if self.target.policy.labels_version:
            self.engine.set_weight_version(str(step))

    def _record(self, step: int, identity: str | None, pause_s: float,
                answers: Sequence[ApplyAnswer]) -> SwitchRecord:
        done = [a.done for a in answers if a.done is not None]
        first = done[0]
        return SwitchRecord(
            model=self.target.name, step=step, identity=identity, pause_s=pause_s,
            at=time.time(), steps=first.steps, kinds=first.kinds,
            apply_s=tuple(d.apply_s for d in done), repack_s=tuple(d.repack_s for d in done),
            downloaded_bytes=tuple(d.downloaded_bytes for d in done), changed=first.changed,
            numel=first.numel, **self._kv_record())

    def _kv_record(self) -> dict[str, Any]:
        kv = self._kv_done
        if kv is None:
            return {}
        return {"in_flight": kv.in_flight, "kept": kv.kept, "recomputed": kv.recomputed,
                "recompute_tokens": kv.recompute_tokens, "resalted": kv.resalted}

    def _parse(self, parse: Any, raw: Sequence[Any], i: int, step: int) -> Any:
        """Answer ``i`` parsed, or (missing, of the wrong shape or from another rank: a late
        answer to an earlier broadcast) an ``unknown`` answer for that rank."""
        try:
            answer = parse(raw[i]) if i < len(raw) else None
        except DeltaSyncError as exc:
            logger.error("deltasync %s rank %d: %s", self.target.name, i, exc)
            answer = None
        if answer is None or answer.rank != i:
            return ApplyAnswer(i, Outcome.UNKNOWN, error=(
                f"no answer to deltasync_apply({step}) (got {type(raw[i]).__name__ if i < len(raw) else 'nothing'})"))
        return answer

    def _raised(self, step: int, what: str, exc: BaseException) -> SwitchResult:
        """The apply broadcast or the engine core's own steps raised: take back on every rank;
        the result carries the :class:`SwitchFailed` to raise. A fatal ``exc`` propagates."""
        if fatal(exc):
            raise exc
        reason = f"step {step}: {what}: {type(exc).__name__}: {exc}"
        out = self.take_back(step, reason)
        out.error = SwitchFailed(reason)
        out.error.__cause__ = exc
        return out

    def commit(self, step: int) -> str | None:
        """Every rank drops the undo of the switch to ``step``; the reason when that failed.

        The switch stands either way (every rank wrote it, the engine core did its part). A
        rank that did not commit keeps reporting ``pending_switch``; the follower sends the
        commit again at the next ticks (idempotent) and starts no switch until no rank
        reports one."""
        try:
            raw = list(self.engine.collective_rpc("deltasync_commit", args=(step,),
                                                  kwargs=self.kwargs))
            answers = [CommitAnswer.from_wire(a) for a in raw]
        except Exception as exc:  # noqa: BLE001 - the switch stands; the commit is retried
            error = f"{type(exc).__name__}: {exc}"
        else:
            bad = [a.rank for a in answers if a.outcome is CommitOutcome.FAILED]
            if not bad and len(answers) >= self.ranks:
                return None
            error = f"ranks {bad or 'missing'} did not commit"
        reason = (f"{self.target.name} step {step}: the commit broadcast failed ({error}); the "
                  "switch stands (every rank applied it); the commit is sent again at the next "
                  "tick")
        logger.error("deltasync %s", reason)
        return reason

    def take_back(self, step: int, reason: str, *, unknown: bool = False) -> SwitchResult:
        """The switch to ``step`` cannot complete: every rank takes it back before any batch
        runs. ``unknown``: some rank already could not put its weights back. When some rank
        cannot now, or the revert broadcast fails, the result is ``unknown``."""
        if unknown:
            return SwitchResult(step, switched=False, reason=reason, unknown=True)
        try:
            raw = list(self.engine.collective_rpc("deltasync_revert", args=(step, reason),
                                                  kwargs=self.kwargs))
            back = [RevertAnswer.from_wire(a) for a in raw]
        except BaseException as exc:
            if fatal(exc):
                raise
            return SwitchResult(step, switched=False, unknown=True, reason=(
                f"{reason}; the revert broadcast failed too: {type(exc).__name__}: {exc}"))
        lost = [a.rank for a in back if not a.outcome.as_before]
        if self._kv_before is not None and self.kv_key is not None:
            self.kv.restore(self.kv_key, self._kv_before[0])  # no batch ran on the new weights
        if len(back) >= self.ranks and not lost:
            policy = self.target.policy
            if policy.resets_prefix_cache and self.config.reset_prefix_cache:
                self.engine.reset_prefix_cache(reset_running_requests=True)  # it may have run
            logger.error("deltasync %s switch to step %d taken back on every rank (%s); it "
                         "keeps its weights until a newer anchor applies: %s", self.target.name,
                         step, ", ".join(f"rank {a.rank}: {a.outcome.value}" for a in back),
                         reason)
            return SwitchResult(step, switched=False, reason=reason)
        return SwitchResult(step, switched=False, unknown=True, reason=(
            f"{reason}; ranks {lost or 'missing'} could not take it back"))


__all__ = ["CommitFailed", "Failpoint", "Switch", "SwitchFailed", "SwitchHeld", "SwitchResult",
           "fatal"]

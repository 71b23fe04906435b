"""One switch, as one unit: every rank applies a step, the prefix cache is reset, the weight
version is set, every rank commits; anything that fails on the way is taken back on every rank,
or the outcome says the engine must hold.

:class:`Switch` is the engine-core half of the switch protocol; its worker half is
``RankState.apply / commit / revert`` (``server/worker/rank.py``), answering through the
``deltasync_*`` RPCs with the typed messages of ``server/messages.py``. A :class:`Switch` runs
the RPCs and reports an :class:`Outcome`; the coordinator (``coordinator.py``) owns what
outlives one switch (the label it set, the hold, the drain, metrics) and acts on the outcome.

Anything that fails between the first ``deltasync_apply`` reaching a rank and the commit:

* some rank answers a failure: taken back (only if every failed rank put its weights back;
  else the outcome is ``hold``);
* the apply broadcast itself raises (an RPC timeout, a rank whose RPC raised): nobody knows
  which ranks wrote, so every rank is asked to revert; a rank holding the pending switch puts it
  back, a rank that never wrote and still holds ``before`` keeps it, any other rank resets and
  answers False (then ``hold``). The outcome carries a :class:`SwitchFailed` to raise (a failed
  tick);
* the engine core's own steps raise: the same revert, and the same error.

The commit only drops the ranks' undo, after the weights and the label are the new step: if
it fails the switch stands (``commit_error``; the coordinator sends it again at the next ticks).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_deltasync.config import SyncConfig
from vllm_deltasync.failpoints import FAIL_SWITCH_ENV
from vllm_deltasync.server.messages import ApplyResult, RankStatus

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
    """The parsed :data:`~vllm_deltasync.failpoints.FAIL_SWITCH_ENV`."""

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


@dataclasses.dataclass
class Outcome:
    """What a :class:`Switch` did."""

    step: int
    switched: bool
    """Every rank applied the step and the label is set (the switch stands)."""
    reason: str | None = None
    """Why it did not switch (taken back, or the engine must hold)."""
    hold: bool = False
    """Some rank could not put its weights back, or the revert broadcast failed."""
    error: SwitchFailed | None = None
    """To raise once the coordinator acted (the apply broadcast or the engine core failed)."""
    pause_s: float = 0.0
    record: dict[str, Any] | None = None
    """The switch as ``deltasync_engine_status`` lists it."""
    commit_error: str | None = None
    """The commit broadcast failed: the switch stands, the commit is sent again."""


class Switch:
    """The switch of ``engine`` (an ``EngineHandle``) to one step, from the ranks' last
    ``statuses``. :meth:`run` never leaves the ranks on two versions without saying so."""

    def __init__(self, engine: Any, config: SyncConfig, statuses: Sequence[RankStatus],
                 failpoint: Failpoint) -> None:
        self.engine = engine
        self.config = config
        self.statuses = list(statuses)
        self.failpoint = failpoint

    def run(self, step: int, identity: str | None = None) -> Outcome:
        first = self.statuses[0] if self.statuses else {}
        before = {"applied_step": first.get("applied_step"), "applied_id": first.get("applied_id")}
        started = time.perf_counter()
        try:
            results: list[ApplyResult] = list(
                self.engine.collective_rpc("deltasync_apply", args=(step, identity)))
        except BaseException as exc:
            return self._raised(step, "the apply broadcast failed, so no rank is known to have "
                                "applied it or not", exc, before)
        pause_s = time.perf_counter() - started
        failed = self.failed_applies(step, results)
        if failed:
            return self.take_back(step, f"step {step}: " + "; ".join(
                f"rank {r.get('rank')}: {r.get('error')}" for r in failed), before,
                revertible=all(r.get("reverted") is True for r in failed))
        try:
            self.failpoint.at_switch(step)
            if self.config.reset_prefix_cache:
                self.engine.reset_prefix_cache(reset_running_requests=True)
            self.engine.set_weight_version(str(step))
        except BaseException as exc:
            return self._raised(step, "the engine core failed the switch after the ranks "
                                "applied it", exc, before)
        record = {"step": step, "identity": identity, "pause_s": pause_s, "at": time.time(),
                  "steps": results[0].get("steps"), "kinds": results[0].get("kinds"),
                  "apply_s": [r.get("apply_s") for r in results],
                  "repack_s": [r.get("repack_s") for r in results],
                  "downloaded_bytes": [r.get("downloaded_bytes") for r in results],
                  "changed": results[0].get("changed"), "numel": results[0].get("numel")}
        return Outcome(step, switched=True, pause_s=pause_s, record=record,
                       commit_error=self.commit(step))

    def _raised(self, step: int, what: str, exc: BaseException,
                before: Mapping[str, Any]) -> Outcome:
        """The apply broadcast or the engine core's own steps raised: take back on every rank;
        the outcome carries the :class:`SwitchFailed` to raise. A fatal ``exc`` propagates."""
        if fatal(exc):
            raise exc
        reason = f"step {step}: {what}: {type(exc).__name__}: {exc}"
        out = self.take_back(step, reason, before)
        out.error = SwitchFailed(reason)
        out.error.__cause__ = exc
        return out

    def failed_applies(self, step: int, results: Sequence[Any]) -> list[Mapping[str, Any]]:
        """The failed answers to ``deltasync_apply``; an answer of the wrong shape or from the
        wrong rank (a late answer to an earlier broadcast) or a missing one is a failure whose
        rank did not put anything back."""
        failed: list[Mapping[str, Any]] = []
        ranks = max(len(self.statuses), len(results))
        for i in range(ranks):
            r = results[i] if i < len(results) else None
            want = self.statuses[i].get("rank", i) if i < len(self.statuses) else i
            if not isinstance(r, Mapping) or "ok" not in r or r.get("rank", want) != want:
                failed.append({"rank": want, "reverted": False,
                               "error": f"no answer to deltasync_apply({step}) (got "
                                        f"{type(r).__name__})"})
            elif r.get("ok") is not True:
                failed.append(r)
        return failed

    def commit(self, step: int) -> str | None:
        """Every rank drops the undo of the switch to ``step``; the reason when that failed.

        The switch stands either way (every rank wrote it, the label is set). A rank that did
        not commit keeps reporting ``pending_switch``; the coordinator sends the commit again
        at the next ticks (idempotent) and starts no switch until no rank reports one."""
        try:
            answers = list(self.engine.collective_rpc("deltasync_commit", args=(step,)))
        except Exception as exc:  # noqa: BLE001 - the switch stands; the commit is retried
            error = f"{type(exc).__name__}: {exc}"
        else:
            bad = [i for i, a in enumerate(answers) if not isinstance(a, bool)]
            if not bad and len(answers) >= len(self.statuses):
                return None
            error = f"ranks {bad or 'missing'} did not answer the commit"
        reason = (f"step {step}: the commit broadcast failed ({error}); the switch stands (every "
                  "rank applied it, the label is set); the commit is sent again at the next tick")
        logger.error("deltasync %s", reason)
        return reason

    def take_back(self, step: int, reason: str, before: Mapping[str, Any], *,
                  revertible: bool = True) -> Outcome:
        """The switch to ``step`` cannot complete: every rank takes it back before any batch
        runs, and the version label stays what the weights are again (``before``: the applied
        step and identity every rank held before the switch). ``revertible`` False: some rank
        already could not put its weights back. When some rank cannot, or the revert
        broadcast fails, the outcome is ``hold``."""
        if not revertible:
            return Outcome(step, switched=False, reason=reason, hold=True)
        try:
            back = list(self.engine.collective_rpc("deltasync_revert",
                                                   args=(step, reason, dict(before))))
        except BaseException as exc:
            if fatal(exc):
                raise
            return Outcome(step, switched=False, hold=True, reason=(
                f"{reason}; the revert broadcast failed too: {type(exc).__name__}: {exc}"))
        if back and len(back) >= len(self.statuses) and all(ok is True for ok in back):
            if self.config.reset_prefix_cache:  # it may have run half-way: start clean
                self.engine.reset_prefix_cache(reset_running_requests=True)
            logger.error("deltasync switch to step %d taken back on every rank; serving "
                         "version %s until a newer anchor applies: %s", step,
                         self.engine.get_weight_version(), reason)
            return Outcome(step, switched=False, reason=reason)
        return Outcome(step, switched=False, hold=True, reason=reason + "; ranks " + ", ".join(
            str(i) for i, ok in enumerate(back) if ok is not True) + " could not take it back")


__all__ = ["CommitFailed", "Failpoint", "Outcome", "Switch", "SwitchFailed", "SwitchHeld",
           "fatal"]

"""The speculative drafter's switches, run by the engine core's coordinator at each tick.

A server started with a draft model (``speculative_config``, method ``draft_model``) and a
drafter bucket (``drafter_url``) follows two buckets: the policy's (the coordinator's own
switch, :mod:`.switch`) and the drafter's, here. Every rank stages the drafter's steps as it
does the policy's (its own shard map, proof and poller: ``RankState(role="drafter")``) and
answers them in the ``drafter`` key of its ``deltasync_status``. When every rank has the same
next drafter step ready, the drafter switches on every rank in the same tick as (and right
before) any policy switch: between the same two batches, all ranks at once.

What differs from the policy, on purpose:

- a drafter switch never holds or drains anything, and never waits for the policy (nor the
  policy for it): with rejection sampling the draft changes how fast tokens come, never which
  tokens (speculative decoding's output distribution is the target's);
- no prefix-cache reset and no weight-version label: both belong to the policy's weights. The
  drafter's cached KV for a prefix may come from an older draft (acceptance only);
- a failed drafter switch is taken back on every rank (``deltasync_revert(model="drafter")``;
  a rank that cannot put it back forgets its drafter step and waits for an anchor), counted,
  logged and shown on ``/synced`` and in the engine status; the drafter keeps serving its last
  good weights and the next ready step is tried at a later tick.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_deltasync._urls import redact_text

logger = logging.getLogger(__name__)

DRAFTER = {"model": "drafter"}


class DrafterFollower:
    """The coordinator's drafter part: reads the ranks' ``drafter`` statuses, switches."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.statuses: list[Mapping[str, Any]] = []
        self.switches: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        self.failures = 0
        self.last_error: str | None = None

    @staticmethod
    def of(statuses: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Every rank's drafter status, or [] when some rank has none (no drafter bucket)."""
        found = [s.get("drafter") for s in statuses if isinstance(s, Mapping)]
        if not found or not all(isinstance(d, Mapping) for d in found):
            return []
        return [d for d in found if isinstance(d, Mapping)]

    def tick(self, statuses: Sequence[Mapping[str, Any]], *, may_switch: bool) -> None:
        from vllm_deltasync.server.engine.coordinator import common_ready

        self.statuses = self.of(statuses)
        if not self.statuses or any(d.get("refused") for d in self.statuses) or not may_switch:
            return
        found = common_ready(self.statuses)
        if found is None:
            return
        step, identity = found
        self._switch(step, identity)

    def _switch(self, step: int, identity: str | None) -> None:
        first = self.statuses[0]
        before = {"applied_step": first.get("applied_step"), "applied_id": first.get("applied_id")}
        started = time.perf_counter()
        reason: str | None = None
        try:
            results = list(self.engine.collective_rpc("deltasync_apply", args=(step, identity),
                                                      kwargs=DRAFTER))
            failed = [r for r in results if not (isinstance(r, Mapping) and r.get("ok"))]
            if failed:
                reason = "; ".join(f"rank {r.get('rank')}: {r.get('error')}" if
                                   isinstance(r, Mapping) else repr(r) for r in failed)
            else:
                commits = list(self.engine.collective_rpc("deltasync_commit", args=(step,),
                                                          kwargs=DRAFTER))
                if any(c is None for c in commits):
                    reason = f"the commit failed on ranks {[i for i, c in enumerate(commits) if c is None]}"
        except Exception as exc:  # noqa: BLE001 - the drafter never takes the engine down
            reason = f"{type(exc).__name__}: {exc}"
        if reason is None:
            self.last_error = None
            self.switches.append({"step": step, "at": time.time(),
                                  "pause_s": time.perf_counter() - started})
            logger.info("deltasync: drafter switched to step %d on every rank (%.3fs)", step,
                        time.perf_counter() - started)
            return
        self.failures += 1
        self.last_error = redact_text(f"drafter step {step}: {reason}")
        logger.error("deltasync: the drafter's switch to step %d failed, taken back on every "
                     "rank; the drafter keeps its weights: %s", step, self.last_error)
        try:
            self.engine.collective_rpc("deltasync_revert",
                                       args=(step, self.last_error, before), kwargs=DRAFTER)
        except Exception as exc:  # noqa: BLE001 - logged; the ranks reset at their next apply
            logger.error("deltasync: the drafter's revert of step %d failed: %s", step, exc)

    def status(self) -> dict[str, Any] | None:
        """For the engine status (``deltasync_engine_status``); None without a drafter."""
        if not self.statuses:
            return None
        return {"switches": list(self.switches), "failures": self.failures,
                "last_error": self.last_error,
                "ranks": [{k: d.get(k) for k in ("rank", "applied_step", "applied_id",
                                                 "staged_step", "newest_step", "last_error",
                                                 "refused")} for d in self.statuses]}


__all__ = ["DrafterFollower"]

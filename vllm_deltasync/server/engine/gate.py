"""Whether the engine core schedules batches: the hold and the drain around switches.

vLLM's scheduler has a pause state (``UNPAUSED``, ``PAUSED_NEW``: no new request is admitted,
``PAUSED_ALL``: no batch runs). Two things set it here, and only here:

- a **hold**: the ranks of a target whose policy ``holds_engine`` (the policy) cannot say which
  weights they hold; nothing runs until a switch every rank applied releases it;
- a **drain** (``in_flight="drain"``): before a switch, new requests wait until the running
  ones finish (at most ``max_drain_wait_s``).

A hold outranks a drain: releasing a drain never unpauses a held engine. The pause states
(vLLM's ``PauseState``) are handed in, so nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


class Gate:
    """The engine core's scheduling pause, owned by the coordinator (module doc)."""

    def __init__(self, engine: Any, pause_states: Any, max_drain_wait_s: float) -> None:
        self._engine = engine
        self._pause = pause_states
        self._max_drain_wait_s = max_drain_wait_s
        self.holders: set[str] = set()
        """Targets holding the engine (their name)."""
        self._drain_since: float | None = None
        self._paused_by_drain = False

    @property
    def held(self) -> bool:
        return bool(self.holders)

    @property
    def draining(self) -> bool:
        return self._drain_since is not None

    def hold(self, name: str) -> None:
        """No batch runs (first thing, so nothing runs on mixed weights whatever fails next)."""
        self.holders.add(name)
        self._engine.scheduler.set_pause_state(self._pause.PAUSED_ALL)
        self._drain_since, self._paused_by_drain = None, False  # the hold owns the pause now

    def keep_held(self) -> None:
        """While held: put the pause back if something else changed it."""
        sched = self._engine.scheduler
        if self.holders and sched.pause_state != self._pause.PAUSED_ALL:
            sched.set_pause_state(self._pause.PAUSED_ALL)

    def release(self, name: str) -> None:
        self.holders.discard(name)
        if not self.holders:
            self._engine.scheduler.set_pause_state(self._pause.UNPAUSED)

    def drained(self) -> bool:
        """True when no request runs, or the drain waited ``max_drain_wait_s``; starts the
        drain (new requests wait) on its first call."""
        sched = self._engine.scheduler
        if not sched.has_unfinished_requests():
            return True
        now = time.monotonic()
        if self._drain_since is None:
            self._drain_since = now
            if sched.pause_state == self._pause.UNPAUSED:
                sched.set_pause_state(self._pause.PAUSED_NEW)
                self._paused_by_drain = True
        if now - self._drain_since >= self._max_drain_wait_s:
            logger.warning("deltasync: requests still running after %.1fs of drain; switching",
                           now - self._drain_since)
            return True
        return False

    def release_drain(self) -> None:
        self._drain_since = None
        if self._paused_by_drain:
            self._paused_by_drain = False
            if not self.holders:  # a hold keeps everything paused until it is released
                self._engine.scheduler.set_pause_state(self._pause.UNPAUSED)


__all__ = ["Gate"]

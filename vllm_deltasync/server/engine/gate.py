"""Whether the engine core schedules batches: the hold and the drain around switches.

vLLM's scheduler has a pause state (``UNPAUSED``, ``PAUSED_NEW``: no new request is admitted,
``PAUSED_ALL``: no batch runs). Two things set it here, and only here:

- a **hold**: the ranks of a target whose policy ``holds_engine`` (the policy) cannot say which
  weights they hold; nothing runs until a switch every rank applied releases it;
- a **drain** (``in_flight="drain"``): before a switch, new requests wait until the running
  ones finish (at most ``max_drain_wait_s``).

A hold outranks a drain: releasing a drain never unpauses a held engine. The engine is the
typed handle of ``handle.py``.
"""

from __future__ import annotations

import logging
import time

from vllm_deltasync.server.engine.handle import EngineCore

logger = logging.getLogger(__name__)


class Gate:
    """The engine core's scheduling pause, owned by the coordinator (module doc)."""

    def __init__(self, engine: EngineCore, max_drain_wait_s: float) -> None:
        self._engine = engine
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
        self._engine.set_pause("all")
        self._drain_since, self._paused_by_drain = None, False  # the hold owns the pause now

    def keep_held(self) -> None:
        """While held: put the pause back if something else changed it."""
        if self.holders and self._engine.pause() != "all":
            self._engine.set_pause("all")

    def release(self, name: str) -> None:
        self.holders.discard(name)
        if not self.holders:
            self._engine.set_pause("none")

    def drained(self) -> bool:
        """True when no request runs, or the drain waited ``max_drain_wait_s``; starts the
        drain (new requests wait) on its first call."""
        if not self._engine.has_unfinished_requests():
            return True
        now = time.monotonic()
        if self._drain_since is None:
            self._drain_since = now
            if self._engine.pause() == "none":
                self._engine.set_pause("new")
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
                self._engine.set_pause("none")


__all__ = ["Gate"]

"""Waiting on something the code signals, instead of sleeping long enough on a good day."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, *,
               interval: float = 0.01, status: Callable[[], object] | None = None) -> T:
    """Poll ``predicate`` until it returns something true, and return that; past ``timeout``
    seconds fail the test saying ``what`` was awaited (and ``status()``, when given, the state
    it was in). A condition true at once costs no wait; a slow host only waits longer."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            seen = "" if status is None else f"; last seen: {status()}"
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{seen}")
        time.sleep(interval)

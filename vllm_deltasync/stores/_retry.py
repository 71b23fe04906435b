"""Retries with jittered backoff, shared by the network stores.

Only :class:`~vllm_deltasync.errors.TransientStoreError` (5xx, dropped connection, timeout)
and its subclass :class:`~vllm_deltasync.errors.RateLimitedError` (429) are retried; every
other store error is final and raised at once.

A :class:`RateGate` is shared by every request of one store (one gate per rate-limit bucket,
e.g. ``api`` and ``resolve`` on the Hub): once a 429 advertises a reset, no request of that
bucket leaves before the reset, whichever coroutine got the 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from vllm_deltasync.errors import ConfigError, RateLimitedError, TransientStoreError

logger = logging.getLogger(__name__)

T = TypeVar("T")

_RATELIMIT_T = re.compile(r"""(?:^|[;,\s])t\s*=\s*(\d+(?:\.\d+)?)""")
_RATELIMIT_R = re.compile(r"""(?:^|[;,\s])r\s*=\s*(\d+)""")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a store retries transient failures."""

    attempts: int = 5
    """Total tries of one operation (1 = no retry)."""
    base_delay_s: float = 0.25
    """First backoff ceiling; doubles per attempt (full jitter below the ceiling)."""
    max_delay_s: float = 30.0
    """Upper bound of one backoff sleep after a 5xx or a dropped connection."""
    max_rate_limit_wait_s: float = 330.0
    """Longest wait accepted from a 429's advertised reset (the Hub's window is 5 minutes)."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"RetryPolicy.attempts={self.attempts}: use 1 or more")
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ConfigError(
                f"RetryPolicy delays base={self.base_delay_s} max={self.max_delay_s}: "
                "use 0 <= base_delay_s <= max_delay_s"
            )

    def backoff_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Sleep before retry number ``attempt`` (0-based): full jitter in [0, ceiling]."""
        ceiling = min(self.max_delay_s, self.base_delay_s * (2**attempt))
        return (rng or random).uniform(0.0, ceiling)


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait from ``RateLimit: "api";r=0;t=42`` and/or ``Retry-After: 42``.

    The larger of the two wins; an HTTP-date ``Retry-After`` is ignored (the Hub sends seconds).
    """
    waits: list[float] = []
    limit = headers.get("RateLimit")
    if limit:
        found = _RATELIMIT_T.search(limit)
        if found:
            waits.append(float(found.group(1)))
    retry_after = headers.get("Retry-After")
    if retry_after:
        with contextlib.suppress(ValueError):
            waits.append(float(retry_after))
    return max(waits) if waits else None


def parse_remaining(headers: Mapping[str, str]) -> int | None:
    """Requests left in the window from a ``RateLimit`` header, if the server sent one."""
    limit = headers.get("RateLimit")
    found = _RATELIMIT_R.search(limit) if limit else None
    return int(found.group(1)) if found else None


class RateGate:
    """Holds every request of one rate-limit bucket until an advertised reset has passed."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self._clock = clock
        self._open_at = 0.0

    def block_for(self, seconds: float) -> None:
        """No request may leave during the next ``seconds``."""
        self._open_at = max(self._open_at, self._clock() + seconds)

    @property
    def wait_s(self) -> float:
        """Seconds until the gate opens (0 when open)."""
        return max(0.0, self._open_at - self._clock())

    async def wait(self) -> None:
        """Sleep until the gate is open; re-checks because another 429 may extend it."""
        while (delay := self.wait_s) > 0:
            await asyncio.sleep(delay)


async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    policy: RetryPolicy,
    gate: RateGate | None = None,
    on_retry: Callable[[TransientStoreError], None] | None = None,
) -> T:
    """Run ``call`` until it succeeds, retrying transient errors with jittered backoff.

    A :class:`RateLimitedError` closes ``gate`` for its ``retry_after_s`` (plus a little
    jitter so replicas sharing a token do not return in lockstep); the next try waits there.
    """
    for attempt in range(policy.attempts):
        if gate is not None:
            await gate.wait()
        try:
            return await call()
        except TransientStoreError as exc:
            if attempt + 1 >= policy.attempts:
                raise
            delay = _delay_after(exc, attempt, policy, gate)
            if on_retry is not None:
                on_retry(exc)
            logger.debug("retrying %s attempt=%d in %.2fs: %s", what, attempt + 1, delay, exc)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def _delay_after(
    exc: TransientStoreError, attempt: int, policy: RetryPolicy, gate: RateGate | None
) -> float:
    if isinstance(exc, RateLimitedError) and exc.retry_after_s is not None:
        if exc.retry_after_s > policy.max_rate_limit_wait_s:
            raise exc
        wait = exc.retry_after_s + random.uniform(0.0, max(policy.base_delay_s, 0.01))
        if gate is not None:
            gate.block_for(wait)
            return 0.0
        return wait
    return policy.backoff_s(attempt)


__all__ = ["RateGate", "RetryPolicy", "parse_remaining", "parse_retry_after", "retry"]

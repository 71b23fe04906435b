"""Cheap, rate-limit-aware discovery of newly committed steps in a bucket.

API (used by the poller)::

    watcher = StepWatcher(store)                  # any Store; hf:// adds the events feed
    step = await watcher.wait_for_new(after=41, timeout_s=30.0)
    # -> the newest committed step > 41 known to the watcher (may skip steps: the reader plans
    #    the chain), or None when nothing new arrived within timeout_s. after=None: any step.
    watcher.latest                                # newest committed step seen, or None
    watcher.stats                                 # WatcherStats counters (for metrics.py)
    await watcher.close()                         # stops the events task

How it finds a step (a step is committed when ``manifests/{step:012d}.json`` exists):

1. **Events feed** when the store has one (``store.changes(cursor)``, hf:// today): one
   long-lived connection; a ``changes`` event naming a manifest is a new step, at no request
   cost. Connections are paced (``events_min_connect_interval_s``) and resume from the last
   cursor. A feed that is unavailable (401/403/404/501) switches to polling and is retried
   every ``events_retry_s``.
2. **Probing** otherwise: ``stat`` (one HEAD on hf://, a resolve call, not an API call) of the
   next expected immutable name ``manifests/{latest + stride}.json`` every ``probe_interval_s``
   (jittered); ``stride`` is the last observed step gap, so a trainer publishing every k
   steps is probed at the right name. A hit is followed by immediate probes of the next
   names until a miss (catching up costs one call per step).
3. **Full listing** (one API call per page) at start-up, after a feed ``reset``, and every
   ``listing_interval_s`` as a safety net for gaps the probe cannot guess.

429 answers are honoured (the store's rate gate holds every request until the reset), other
transient failures back off with jitter; counters say what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from vllm_deltasync.errors import ConfigError, RateLimitedError, StoreError, TransientStoreError
from vllm_deltasync.format.layout import MANIFEST_DIR, manifest_path, parse_manifest_path
from vllm_deltasync.stores._retry import RetryPolicy
from vllm_deltasync.stores.base import Store

logger = logging.getLogger(__name__)

@dataclass
class WatcherStats:
    """What discovery is doing (read by the metrics layer)."""

    mode: str = "idle"
    """``events`` (feed connected), ``polling`` (probing), or ``idle`` (not started)."""
    probes: int = 0
    probe_hits: int = 0
    listings: int = 0
    events_connects: int = 0
    events_received: int = 0
    events_unavailable: int = 0
    events_malformed: int = 0
    """Feed events that were not the documented JSON (skipped; a listing follows)."""
    events_silent: int = 0
    """Feed connections that stayed silent past ``events_idle_s``, or missed a step a probe
    found (the feed is then distrusted for ``events_retry_s`` and discovery polls)."""
    rate_limited: int = 0
    errors: int = 0
    pace_factor: float = 1.0
    """How much the probe/listing intervals are stretched to fit the shared quota (1 = not)."""


class QuotaPacer:
    """Stretches an interval so the burn rate seen on a shared quota fits what is left of it.

    Every replica sharing a token sees the same ``RateLimit`` remaining count fall; from two
    readings it knows the fleet's burn rate, hence the requests the window would still take at
    this pace. When that exceeds ``share`` of what remains, the interval grows by the ratio
    (each replica does the same, so the fleet slows together); it shrinks back as room returns.
    """

    def __init__(self, share: float = 0.5, max_factor: float = 64.0) -> None:
        self.share = share
        self.max_factor = max_factor
        self.factor = 1.0
        self._last: tuple[float, int, float] | None = None

    def update(self, remaining: int, reset_s: float, now: float) -> float:
        """Feed one reading (requests left, seconds to reset); returns the interval factor."""
        last, reset_at = self._last, now + reset_s
        self._last = (now, remaining, reset_at)
        if last is None or remaining > last[1] or abs(last[2] - reset_at) > 1.5 or now <= last[0]:
            return self.factor  # first reading or a new window: no burn rate yet
        burn = (last[1] - remaining) / (now - last[0])
        budget = self.share * remaining
        target = self.max_factor if budget <= 0 else self.factor * burn * reset_s / budget
        self.factor = min(self.max_factor, max(1.0, target))
        return self.factor


class StepWatcher:
    """Tells the poller when a newer committed step exists in ``store``.

    Options (defaults keep 32 replicas on one Hub token well under the free tier, see
    docs/transports.md): ``probe_interval_s`` between probes when there is no feed;
    ``listing_interval_s`` between safety-net listings once a step is known (and
    ``empty_listing_interval_s`` while the bucket has none); ``use_events`` to follow the
    store's feed when it has one, ``events_retry_s`` before trying an unavailable feed again,
    ``events_min_connect_interval_s`` between feed connections; ``retry_policy`` for backoff;
    ``pace_to_quota`` stretches intervals when the store reports a shared quota running out
    (:class:`QuotaPacer`, from the Hub's ``RateLimit`` headers).
    """

    def __init__(
        self,
        store: Store,
        *,
        probe_interval_s: float = 10.0,
        listing_interval_s: float = 600.0,
        empty_listing_interval_s: float = 30.0,
        use_events: bool = True,
        events_retry_s: float = 600.0,
        events_min_connect_interval_s: float = 30.0,
        retry_policy: RetryPolicy | None = None,
        pace_to_quota: bool = True,
        events_idle_s: float = 120.0,
        events_check_s: float | None = None,
    ) -> None:
        if probe_interval_s <= 0 or listing_interval_s < probe_interval_s:
            raise ConfigError(
                f"StepWatcher({store.url}): probe_interval_s={probe_interval_s}, listing_interval_s="
                f"{listing_interval_s}; use probe_interval_s > 0 and listing_interval_s >= probe_interval_s"
            )
        self.store = store
        self.probe_interval_s = probe_interval_s
        self.listing_interval_s = listing_interval_s
        self.empty_listing_interval_s = empty_listing_interval_s
        self.use_events = use_events and hasattr(store, "changes")
        self.events_retry_s = events_retry_s
        self.events_min_connect_interval_s = events_min_connect_interval_s
        self.retry_policy = retry_policy or RetryPolicy()
        self.stats = WatcherStats()
        self.latest: int | None = None
        self.stride = 1
        self._listed_at: float | None = None
        self._listing: asyncio.Future[None] | None = None
        """The listing in flight (:meth:`_list`), awaited by rounds until it ends."""
        self._set_aside: set[int] = set()
        """Listed steps whose manifest does not read (:meth:`set_aside`): never the latest."""
        self._wake = asyncio.Event()
        self._events_task: asyncio.Task[None] | None = None
        self._feed_live = False
        self._failures = 0
        self.pace_to_quota = pace_to_quota
        self._pacers = {"api": QuotaPacer(), "resolve": QuotaPacer()}
        self.events_idle_s = events_idle_s
        self.events_check_s = (
            max(3 * probe_interval_s, 30.0) if events_check_s is None else events_check_s
        )
        self._checked_at = time.monotonic()
        self._distrust_until = 0.0

    # -- public ------------------------------------------------------------------------------

    async def wait_for_new(self, after: int | None, timeout_s: float) -> int | None:
        """The newest committed step > ``after`` (any step when None), or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._start_events()
        try:
            while True:
                self._wake.clear()  # set again by any step noted from here on
                if self._newer(after):
                    return self.latest
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                async with asyncio.timeout(left):  # not wait_for: 3.11's may swallow a cancel
                    await self._round(after, deadline)
        except TimeoutError:
            return self.latest if self._newer(after) else None

    def rewound(self) -> None:
        """The bucket went back (the reader found the applied step gone or rewritten: a
        trainer restart, a wiped bucket): forget the newest step seen and list again at the
        next round, so the listing's newest step is taken even when it is older."""
        if self.latest is not None:
            logger.warning("%s went back: forgetting step %d, listing again",
                           self.store.url, self.latest)
        self.latest = None
        self.stride = 1
        self._listed_at = None
        self._set_aside.clear()  # another history: those names may hold readable steps now

    def set_aside(self, step: int, newest: int | None) -> None:
        """``step`` is listed but its manifest does not read (garbage under a step's name, a
        format this release cannot read): it is never the latest step again; ``newest`` (the
        newest readable step below it) is, and probing goes on from there."""
        self._set_aside.add(step)
        while len(self._set_aside) > 64:
            self._set_aside.discard(max(self._set_aside))
        if self.latest is None or self.latest >= step:
            self.latest = newest
            self.stride = 1

    async def close(self) -> None:
        if self._listing is not None:
            self._listing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listing
            self._listing = None
        if self._events_task is not None:
            self._events_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._events_task
            self._events_task = None

    # -- one round: list, probe, or wait for the feed ------------------------------------------

    def _newer(self, after: int | None) -> bool:
        return self.latest is not None and (after is None or self.latest > after)

    async def _round(self, after: int | None, deadline: float) -> None:
        """One look at the bucket. A round that finds nothing newer than ``after`` lasts at
        least ``probe_interval_s`` (or until a step is noted): whatever the bucket holds (a
        set-aside manifest under the next name, a listing that keeps naming one), discovery
        never asks it more often than that."""
        began = time.monotonic()
        await self._look(after, deadline)
        if not self._newer(after):
            await self._sleep_or_wake(min(deadline, began + self.probe_interval_s) - time.monotonic())

    async def _look(self, after: int | None, deadline: float) -> None:
        try:
            if self._listing_due():
                await self._list()
            elif self._feed_live:
                self.stats.mode = "events"
                if time.monotonic() - self._checked_at >= self.events_check_s:
                    await self._check_feed(after)
                wake_at = min(deadline, self._next_listing(), self._checked_at + self.events_check_s)
                await self._sleep_or_wake(wake_at - time.monotonic())
            else:
                self.stats.mode = "polling"
                if not await self._probe(after):
                    await self._sleep_or_wake(self._probe_pause())
            self._failures = 0
        except TransientStoreError as exc:
            await self._back_off(exc)

    async def _check_feed(self, after: int | None) -> None:
        """While the feed is live and has announced nothing for ``events_check_s``, probe the
        next name: a step the feed did not announce means it went silent; distrust it (poll)
        for ``events_retry_s``."""
        self._checked_at = time.monotonic()
        known = self.latest
        if known is None:
            return
        candidate = self._next_name(known)
        self.stats.probes += 1
        if await self.store.stat(manifest_path(candidate)) is None:
            return
        self.stats.probe_hits += 1
        self._note(candidate)
        self._count_feed("silent")
        logger.warning("events feed of %s missed step %d; polling instead for %.0fs",
                       self.store.url, candidate, self.events_retry_s)
        self._distrust_feed()

    def _count_feed(self, outcome: str) -> None:
        """A feed fault, in the watcher's stats and the store's request counters (exported as
        ``op="events"``, ``outcome="malformed"`` / ``"silent"``: a fixed label set)."""
        setattr(self.stats, f"events_{outcome}", getattr(self.stats, f"events_{outcome}") + 1)
        stats = getattr(self.store, "stats", None)
        if stats is not None:
            stats.count("events", outcome)

    def _distrust_feed(self) -> None:
        self._feed_live = False
        self._distrust_until = time.monotonic() + self.events_retry_s
        if self._events_task is not None:
            self._events_task.cancel()
            self._events_task = None

    def _listing_due(self) -> bool:
        return self._listed_at is None or time.monotonic() >= self._next_listing()

    def _listing_interval(self) -> float:
        return self.listing_interval_s if self.latest is not None else self.empty_listing_interval_s

    def _next_listing(self) -> float:
        return (self._listed_at or 0.0) + self._listing_interval() * self._pacers["api"].factor

    def _pace(self, kind: str) -> float:
        """Interval factor for quota ``kind`` from the store's last ``RateLimit`` reading."""
        quota_left = getattr(self.store, "quota_left", None)
        reading = quota_left(kind) if quota_left is not None and self.pace_to_quota else None
        if reading is None:
            return 1.0
        factor = self._pacers[kind].update(reading[0], reading[1], time.monotonic())
        self.stats.pace_factor = max(p.factor for p in self._pacers.values())
        return factor

    def _probe_pause(self) -> float:
        pause = self._jittered(self.probe_interval_s) * self._pace("resolve")
        quota_left = getattr(self.store, "quota_left", None)
        reading = quota_left("resolve") if quota_left is not None else None
        return min(pause, max(self.probe_interval_s, reading[1])) if reading else pause

    async def _list(self) -> None:
        """List ``manifests/``. The listing runs as a task of its own that outlives the round
        awaiting it: a listing slower than the poll interval (a slow link, a long paginated
        prefix, an S3 client being created) is not cancelled at every round's deadline and
        started over (discovery would never finish one); the next round awaits the same one."""
        task = self._listing
        if task is None or task.done():
            task = self._listing = asyncio.ensure_future(self._list_now())
            task.add_done_callback(_retrieve)
        try:
            await asyncio.shield(task)
        finally:
            if task.done() and self._listing is task:
                self._listing = None

    async def _list_now(self) -> None:
        self.stats.listings += 1
        infos = await self.store.list(f"{MANIFEST_DIR}/")
        self._listed_at = time.monotonic()
        self._pace("api")
        steps = sorted(s for s in (parse_manifest_path(i.path) for i in infos)
                       if s is not None and s not in self._set_aside)
        for step in steps[-2:]:
            self._note(step)

    async def _probe(self, after: int | None) -> bool:
        """Probe the next expected names; True when at least one was found."""
        base = (
            self.latest
            if after is None or (self.latest is not None and self.latest > after)
            else after
        )
        if base is None:
            await self._sleep_or_wake(self._next_listing() - time.monotonic())
            return False
        found = False
        while True:
            self.stats.probes += 1
            candidate = self._next_name(base)
            if await self.store.stat(manifest_path(candidate)) is None:
                return found
            self.stats.probe_hits += 1
            self._note(candidate)
            base, found = candidate, True

    def _next_name(self, known: int) -> int:
        """The next step name to probe after ``known``: ``stride`` on, past set-aside names
        (a manifest known not to read is never probed again, nor taken for a new step)."""
        candidate = known + self.stride
        while candidate in self._set_aside:
            candidate += self.stride
        return candidate

    def _note(self, step: int) -> None:
        if step in self._set_aside or (self.latest is not None and step <= self.latest):
            return
        if self.latest is not None:
            self.stride = step - self.latest
        self.latest = step
        self._wake.set()

    async def _sleep_or_wake(self, seconds: float) -> None:
        if seconds <= 0 or self._wake.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    async def _back_off(self, exc: TransientStoreError) -> None:
        self._failures += 1
        if isinstance(exc, RateLimitedError):
            self.stats.rate_limited += 1
            delay = (exc.retry_after_s or self.retry_policy.max_delay_s) + random.uniform(0, 1)
        else:
            self.stats.errors += 1
            delay = self.retry_policy.backoff_s(min(self._failures, 8))
        logger.warning("discovery store=%s backing off %.1fs: %s", self.store.url, delay, exc)
        await asyncio.sleep(delay)

    @staticmethod
    def _jittered(seconds: float) -> float:
        return seconds * random.uniform(0.9, 1.1)

    # -- events feed ---------------------------------------------------------------------------

    def _start_events(self) -> None:
        if (self.use_events and self._events_task is None
                and time.monotonic() >= self._distrust_until):
            self._events_task = asyncio.create_task(self._follow_feed(), name="deltasync-events")

    async def _follow_feed(self) -> None:
        cursor: str | None = None
        while True:
            connected_at = time.monotonic()
            try:
                cursor = await self._consume(cursor)
                self._failures = 0
                wait = self.events_min_connect_interval_s - (time.monotonic() - connected_at)
            except TransientStoreError as exc:
                self._feed_live = False
                self._failures += 1
                wait = self.retry_policy.backoff_s(min(self._failures, 8))
                if isinstance(exc, RateLimitedError) and exc.retry_after_s is not None:
                    self.stats.rate_limited += 1
                    wait = exc.retry_after_s
            except StoreError as exc:
                self._feed_live = False
                self.stats.events_unavailable += 1
                logger.info(
                    "events feed of %s unavailable, polling instead: %s", self.store.url, exc
                )
                wait = self.events_retry_s
            except Exception as exc:  # noqa: BLE001 - a hostile stream must not end the feed task
                self._feed_live = False
                self._count_feed("malformed")
                self._failures += 1
                logger.warning("events feed of %s broke (%s); reconnecting", self.store.url,
                               type(exc).__name__)
                wait = self.retry_policy.backoff_s(min(self._failures, 8))
            if wait > 0:
                await asyncio.sleep(wait)

    async def _consume(self, cursor: str | None) -> str | None:
        feed: Any = self.store.changes(cursor)  # type: ignore[attr-defined]
        self.stats.events_connects += 1
        events = feed.__aiter__()
        try:
            while True:
                try:
                    async with asyncio.timeout(self.events_idle_s):
                        event = await events.__anext__()
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    self._count_feed("silent")
                    raise TransientStoreError(
                        f"{self.store.url}: events feed silent for {self.events_idle_s:g}s; "
                        "polling until it reconnects") from None
                cursor = event.cursor or cursor
                if event.kind == "ready":
                    self._feed_live = True
                    self.stats.mode = "events"
                    self._wake.set()
                elif event.kind == "reset":
                    self._listed_at = None
                    self._wake.set()
                elif event.kind == "malformed":
                    self._count_feed("malformed")
                    soon = time.monotonic() - self._listing_interval() + self.probe_interval_s
                    self._listed_at = min(self._listed_at or soon, soon)  # list, at most this often
                    self._wake.set()
                elif event.kind == "changes":
                    self.stats.events_received += 1
                    self._checked_at = time.monotonic()  # the feed speaks: no probe needed yet
                    for step in (parse_manifest_path(p) for p in event.paths):
                        if step is not None:
                            self._note(step)
        finally:
            self._feed_live = False
            self.stats.mode = "polling"
            with contextlib.suppress(Exception):
                await feed.aclose()
        return cursor


def _retrieve(task: asyncio.Future[None]) -> None:
    """A listing that ended with no round awaiting it: the next round lists again (no
    ``_listed_at`` was set) and meets a lasting error itself; take this one so that asyncio
    does not warn it was never retrieved."""
    if not task.cancelled():
        task.exception()


__all__ = ["QuotaPacer", "StepWatcher", "WatcherStats"]


"""The poller: one per rank, on its own asyncio loop in a daemon thread.

It discovers committed steps newer than what the rank has (``StepWatcher``), plans the chain
(``BucketReader.plan``), downloads and verifies the files holding the tensors this rank needs,
decodes them and hands each step's patches to a ``prepare`` callback (the extension translates
them to the rank's shards and moves them to the device). Prepared steps wait in a bounded
queue until the engine takes them. It never touches live parameters: the worker's main thread
applies what :meth:`SyncState.take` returns, at a batch boundary.

Thread contract: everything shared with the worker's main thread lives in the rank's
:class:`~vllm_deltasync.server.worker.state.SyncState` (``poller.state``), which takes its own
lock; the rest of the poller runs on its loop. How it reaches its bucket is ``bucket.py``; what
a round learns from a failure, ``lapses.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm_deltasync._loop import BackgroundLoop
from vllm_deltasync._urls import redact_text
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import (
    ChainError,
    FingerprintError,
    FormatError,
    IntegrityError,
    NotFoundError,
    UnsupportedFormatError,
)
from vllm_deltasync.format._listing import newest_readable, skipped_line
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.manifest import Manifest
from vllm_deltasync.format.reader import BucketReader, short_id
from vllm_deltasync.server.messages import TargetStatus
from vllm_deltasync.server.metrics import WorkerStats, error_reason
from vllm_deltasync.server.worker.affinity import Placement, format_cpus, plan_staging
from vllm_deltasync.server.worker.bucket import (
    branch_check_s,
    fetch_jitter_s,
    open_node_store,
    open_reader,
    open_watcher,
)
from vllm_deltasync.server.worker.lapses import (
    branch_change,
    failed_stage,
    failed_step,
    loaded_manifest,
    rewritten,
)
from vllm_deltasync.server.worker.state import StagedStep, SyncState

logger = logging.getLogger(__name__)

CORRUPT_RETRY_MAX_S = 300.0
"""Longest wait before a step that failed verification is downloaded again (the wait starts at
the poll interval and doubles per failure); a newer anchor is followed meanwhile."""

Prepare = Callable[[Manifest, list[Any]], tuple[Any, int]]
"""``prepare(manifest, patches) -> (payload, host_bytes)``: runs on a worker thread of the
poller; the payload is what :meth:`SyncState.take` hands back to the applier. ``patches`` holds
the step's patches, or with an ``each`` callback what it returned for each of them."""

Each = Callable[[TensorPatch], Any]
"""``each(patch) -> staged``: runs on a worker thread of the poller for every patch as it is
decoded, so the step never holds all of its decoded patches at once (e.g. translate and stage
them compactly); what it returns is handed to ``prepare`` in place of the patch."""


class Poller:
    """Follows a bucket for one rank and fills its :class:`SyncState`; see the module docstring."""

    def __init__(
        self,
        config: SyncConfig,
        prepare: Prepare,
        *,
        select: Callable[[str], bool] | None = None,
        fingerprint: str | None = None,
        applied_step: int | None = None,
        rank: int = 0,
        reader: BucketReader | None = None,
        stats: WorkerStats | None = None,
        state: SyncState[Any] | None = None,
        each: Each | None = None,
        node_ranks: int = 1,
    ) -> None:
        self.config = config
        self.rank = rank
        self.stats = stats or WorkerStats()
        self.state: SyncState[Any] = state if state is not None else SyncState(applied_step)
        self.state.set_on_room(self._signal_room)
        self._prepare = prepare
        self._each = each
        self._select = select
        self.placement: Placement = plan_staging(config.staging_cpus)
        """Where this rank's staging threads run (``server/worker/affinity.py``): read on the
        creating thread (the worker's main thread, bound to its OpenMP cores)."""
        self._reader = reader or open_reader(config, node_ranks, fingerprint, self.placement.cpus)
        self._reader.thread_init = self.placement.place
        self._reader.select = select  # parse only the tensors this rank reads (format/_selected.py)
        self._reader.remember_failures_s = config.poll_interval_s
        self._watcher = open_watcher(config, self._reader.store)
        self._floor: int | None = None
        self._unplannable: int | None = None
        """The newest step, whose chain did not plan (ChainError): while it is the newest,
        discovery looks for a newer step (the next anchor) before planning it again."""
        self._bad: dict[int, tuple[int, float]] = {}
        """Steps that failed verification -> (failures, monotonic time of the next try)."""
        self.branch_check_s = branch_check_s(config)
        """How often the applied step's manifest is read again from the bucket, to see that
        the bucket still continues it (a trainer restart, a second writer, a wiped bucket)."""
        self._next_branch_check = 0.0
        self._loop = BackgroundLoop(name=f"deltasync-poller-rank{rank}",
                                    thread_init=self.placement.place)
        self._stager = ThreadPoolExecutor(1, thread_name_prefix=f"deltasync-stage-rank{rank}",
                                          initializer=self.placement.place)
        """``each`` and ``prepare`` run on this one thread: one malloc arena holds (and reuses)
        what staging allocates, instead of one per thread of the default executor."""
        self._room: asyncio.Event | None = None
        self._task: Any = None
        self._closing = False
        """Set by :meth:`close`: what fails while the loop is torn down is not reported."""
        self._jitter_s = fetch_jitter_s(config, self._reader.store.scheme)
        self._spread_for: int | None = None
        """The last target waited for (:meth:`_spread`): a step is waited for once."""
        self._main_task: asyncio.Task[Any] | None = None
        self._staged = 0
        """Steps staged so far (a round that staged none waits out the poll interval)."""
        self._aside: tuple[int | None, str] | None = None
        """The last set-aside manifest's report, with the newest readable step at that time."""

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start following the bucket (returns at once)."""
        if self._task is None:
            if self.placement.cpus:
                logger.info("deltasync rank=%d: %s", self.rank, self.placement.describe())
            self._task = self._loop.submit(self._main())

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop thread for good; staged steps are dropped. Never raises: what does
        not stop within ``timeout_s`` (a request stuck in a socket) is logged and left to the
        daemon thread, so a worker shutting down never fails on it."""
        self._closing = True
        self.state.set_on_room(None)
        if self._task is not None:
            self._task.cancel()
        if not self._loop.closed:
            try:
                self._loop.run(self._shutdown(), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - closing is best effort
                logger.debug("poller rank=%d: close failed", self.rank, exc_info=True)
        try:
            self._loop.close()
        except TimeoutError:
            logger.warning("poller rank=%d: its loop did not stop in time; left to its daemon "
                           "thread", self.rank)
        self._stager.shutdown(wait=True, cancel_futures=True)
        self.state.drop_staged()

    def halt(self) -> None:
        """Stop following after the current round, from any thread (the staging thread's
        refusal: :meth:`close` would wait for that thread); :meth:`close` still ends it for
        good."""
        self._closing = True

    async def _shutdown(self) -> None:
        """On the loop: the main task ends first (nothing then uses the reader), then the
        reader and the watcher close."""
        main = self._main_task
        if main is not None and main is not asyncio.current_task():
            main.cancel()
            await asyncio.gather(main, return_exceptions=True)
        await self._reader.close()
        await self._watcher.close()

    # ------------------------------------------------------------ any thread
    def ready_steps(self) -> list[int]:
        """Steps staged and ready, in apply order (each chains on the one before)."""
        return self.state.ready_steps()

    def status(self) -> TargetStatus:
        """What the poller and the rank's sync state know (``server/messages.py``); the rank
        adds the rest (``TargetRank.status``)."""
        snap = self.state.snapshot()
        return TargetStatus(
            rank=self.rank, model="",
            applied_step=snap.applied_step, applied_id=snap.applied_id,
            staged_step=snap.ready_steps[-1] if snap.ready_steps else None,
            ready_steps=snap.ready_steps, ready_ids=snap.ready_ids,
            branch_lost=snap.branch_lost, newest_step=snap.newest_step,
            applied_published_at=snap.applied_published_at,
            newest_published_at=snap.newest_published_at,
            last_discovery_at=snap.last_discovery_at, staged_bytes=snap.staged_bytes,
            last_error=snap.last_error, pending_switch=snap.pending_switch,
            last_apply=snap.last_apply, bucket=self.config.redacted_url(),
            staging_cpus=format_cpus(self.placement.cpus),
            counters=self.stats.snapshot(getattr(self._reader.store, "stats", None)))

    # ------------------------------------------------------------- the loop
    def _signal_room(self) -> None:
        room, loop = self._room, self._loop.running_loop()
        if room is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # loop closed meanwhile
                loop.call_soon_threadsafe(room.set)

    async def _main(self) -> None:
        self._main_task = asyncio.current_task()
        self._room = asyncio.Event()
        if self.config.on_start == "wait":
            self._floor = await self._guarded(self._reader.latest_step(), "discover")
        while not self._closing:
            began, staged = time.monotonic(), self._staged
            try:
                if await self._round():
                    self.state.set_poll_error(self._standing_error())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is reported, then retried
                if self._closing:
                    raise asyncio.CancelledError from exc  # torn down under it: not a failure
                self._report(exc)
                self._remember_bad(exc)
            if self._staged == staged:  # nothing staged: at most one round per poll interval
                await asyncio.sleep(max(0.0, began + self.config.poll_interval_s - time.monotonic()))

    def _remember_bad(self, exc: BaseException) -> None:
        """A step that failed verification is not downloaded again before its backoff ends
        (poll interval doubling per failure, up to ``corrupt_retry_max_s``): a corrupt step
        costs a few requests, not one download per poll."""
        if not isinstance(exc, FormatError) or isinstance(exc, ChainError | FingerprintError):
            return
        step = failed_step(exc)
        if step is None:
            return
        failures = self._bad.get(step, (0, 0.0))[0] + 1
        wait = min(self.config.poll_interval_s * 2 ** min(failures, 20), CORRUPT_RETRY_MAX_S)
        self._bad[step] = (failures, time.monotonic() + wait)
        while len(self._bad) > 64:  # bounded: the oldest steps are forgotten first
            del self._bad[min(self._bad)]
        self._reader.remember_failures_s = wait
        logger.warning("deltasync rank=%d: step %d failed verification (%d time(s)); not "
                       "downloaded again for %.1fs", self.rank, step, failures, wait)

    def _backing_off(self, steps: list[int]) -> int | None:
        now = time.monotonic()
        for step in steps:
            bad = self._bad.get(step)
            if bad is not None and now < bad[1]:
                return step
        return None

    async def _guarded(self, coro: Any, stage: str) -> Any:
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            exc.add_note(f"stage={stage}")
            raise

    def _report(self, exc: BaseException) -> None:
        stage = failed_stage(exc)
        self.stats.add_failure(stage, exc)
        text = redact_text(f"{error_reason(exc)}: {exc}")
        if text != self.state.poll_error():
            logger.error("deltasync rank=%d %s failed: %s", self.rank, stage, text)
        self.state.set_poll_error(text)

    async def _round(self) -> bool:
        """One discovery and staging round; False while a corrupt step is backed off from
        (its error stays reported)."""
        await self._adopt_loaded()
        await self._check_branch()
        base, generation = self.state.plan_base()
        tip = None if base is None else base.step
        after = tip if self._floor is None or (tip is not None and tip > self._floor) else self._floor
        stuck = self._unplannable
        probe = (stuck if stuck is not None and stuck == self._watcher.latest
                 and (after is None or stuck > after) else after)
        target = await self._guarded(
            self._watcher.wait_for_new(after=probe, timeout_s=self.config.poll_interval_s),
            "discover",
        )
        if target is None and probe != after:
            target = stuck  # nothing newer: plan it again (its error stays reported)
        latest = self._watcher.latest
        applied = self.state.applied_manifest()
        if (latest is not None and applied is not None and latest < applied.step
                and self.state.branch_lost() is None):
            await self._check_branch(now=True)  # the bucket went back
            return True
        if latest is not None and self._backing_off([latest]) is not None:
            latest = None  # a corrupt newest step: its manifest is not read again yet
        if target is not None and self._backing_off([target]) is not None:
            return False
        if latest is not None and latest != self.state.newest_step():
            try:
                newest = await self._guarded(self._reader.manifest(latest, fresh=True), "discover")
            except NotFoundError:
                self._watcher.rewound()  # gone since it was seen: list the bucket again
                return True
            except UnsupportedFormatError:
                raise  # a newer format than this release reads: reported, never skipped
            except FormatError as exc:
                await self._set_aside(latest, exc)
                return True
            self.state.saw(latest, newest.created_at)
        else:
            self.state.saw(None, None)
        if target is None:
            return self._backing_off(list(self._bad)) is None
        try:
            plan = await self._guarded(
                self._reader.plan(base, target, max_chain=self.config.max_chain), "discover")
        except ChainError:
            self._unplannable = target
            await self._check_branch(now=True)  # a rewritten chain: is ours still there?
            raise
        self._unplannable = None
        if plan and plan[0].kind == "anchor" and base is not None and base.identity is not None:
            await self._check_branch(now=True)  # through an anchor: say so if ours is gone
        elif plan and applied is not None and base is not None and base.identity == applied.identity:
            # the bucket's newest step names the applied one as its base: the branch holds,
            # no need to read the applied manifest again for a while (a fleet's request budget)
            self._next_branch_check = time.monotonic() + self.branch_check_s
        if plan and base is not None and plan[0].step <= base.step and base is not applied:
            # planned from a staged step or the one being written, the bucket's chain now goes
            # through an anchor at or below it (a second writer, a restart replaced it): drop
            # what is staged and plan from the applied step once that switch ends; staged step
            # numbers only increase (SyncState.take and mark_applied go by number)
            self.state.drop_staged()
            await asyncio.sleep(self.config.poll_interval_s)
            return True
        if self._backing_off([m.step for m in plan]) is not None:
            return False  # a step on the chain failed verification; wait for its backoff or an anchor
        bad = self.state.failed_steps(m.step for m in plan)
        if bad:  # wait for an anchor newer than the step whose switch failed
            self._floor = max(target, self._floor or target)
            logger.warning("deltasync rank=%d: step %d is on a chain through step %d, whose "
                           "switch failed; waiting for a newer anchor", self.rank, target, bad[-1])
            return True
        await self._spread(target)
        below = base
        for manifest in plan:
            await self._wait_for_room()
            staged = await self._stage(manifest, below)
            below = manifest
            if not self.state.stage(generation, staged):
                return True  # reset while staging: plan again from the new base
            self._staged += 1
            logger.info(
                "deltasync staged step=%d kind=%s rank=%d bytes=%d in %.3fs",
                manifest.step, manifest.kind, self.rank, staged.downloaded_bytes, staged.download_s,
            )
        return True

    async def _spread(self, target: int) -> None:
        """No thundering herd: before downloading a step it has not waited for yet, the rank
        waits a random time in [0, :func:`fetch_jitter_s`), so a fleet that discovers a step
        at once spreads its downloads (and the first ones warm a mirror for the rest)."""
        if self._jitter_s <= 0 or target == self._spread_for:
            return
        self._spread_for = target
        await asyncio.sleep(random.uniform(0.0, self._jitter_s))

    async def _set_aside(self, step: int, exc: FormatError) -> None:
        """The newest listed step's manifest does not read (garbage under a step's name,
        another step's manifest): it is never taken as the newest step, which would hide every
        step published after it. The newest step that reads is followed instead; each skipped
        manifest is reported once, by name. (A format this release does not read is not
        skipped: the rank must say it cannot follow, see :class:`UnsupportedFormatError`.)"""
        line = redact_text(skipped_line(self._reader, step, exc))
        logger.warning("deltasync rank=%d: %s", self.rank, line)
        self.stats.add_failure("discover", exc)
        steps = [s for s in await self._guarded(self._reader.list_steps(), "discover") if s < step]
        newest = await self._guarded(newest_readable(self._reader, steps), "discover")
        self._watcher.set_aside(step, None if newest is None else newest[0])
        self._aside = (self._watcher.latest, f"{error_reason(exc)}: {line}")
        self.state.set_poll_error(self._aside[1])

    def _standing_error(self) -> str | None:
        """What a round that went through still reports: the last set-aside manifest, until a
        step newer than the newest readable one at that time is seen (the bucket's newest name
        held no step this rank can follow: status says so in ``last_error`` meanwhile)."""
        if self._aside is None:
            return None
        latest = self._watcher.latest
        if latest is not None and (self._aside[0] is None or latest > self._aside[0]):
            self._aside = None  # a newer step came: the rank follows again
            return None
        return self._aside[1]

    async def _wait_for_room(self) -> None:
        assert self._room is not None
        while True:
            self._room.clear()
            if self.state.has_room(self.config.max_staged_bytes):
                return
            await self._room.wait()

    async def _adopt_loaded(self) -> None:
        """``loaded_step=N`` says the loaded checkpoint is step N: take the identity of the
        bucket's step N now (deltas apply onto that exact manifest), or, when the bucket has
        no step N, treat the weights as unknown (resync through an anchor)."""
        step = self.state.loaded_step()
        if step is None:
            return
        manifest = await self._guarded(loaded_manifest(self._reader, step), "discover")
        reason = (f"loaded_step={step}: the bucket has no step {step}; the loaded weights are "
                  "unknown, resyncing through the newest anchor")
        if self.state.adopt_loaded(manifest, reason):
            if manifest is None:
                logger.warning("deltasync rank=%d %s", self.rank, reason)
            else:
                logger.info("deltasync rank=%d: the loaded checkpoint is step %d (%s, run %s)",
                            self.rank, step, short_id(manifest.identity), manifest.run_id)

    async def _check_branch(self, *, now: bool = False) -> None:
        """Is the applied step still the one the bucket holds under its number? Read its
        manifest again (every ``branch_check_s``, or ``now``); when it is gone or another
        (a trainer restarted from an older checkpoint, a second writer, a wiped bucket) the
        rank is on a branch the bucket no longer continues: say so (log, status, metrics)
        and resync through the newest anchor of the chain the bucket holds now. The weights
        are never moved across: a delta applies only onto the identity it names."""
        applied = self.state.applied_manifest()
        if applied is None or applied.identity is None or self.state.branch_lost() is not None:
            return
        clock = time.monotonic()
        if not now and clock < self._next_branch_check:
            return
        self._next_branch_check = clock + self.branch_check_s
        bad = ""
        try:
            current: Manifest | None = await self._guarded(
                self._reader.manifest(applied.step, fresh=True), "discover")
        except NotFoundError:
            current = None
        except FormatError as exc:
            current, bad = None, str(exc)
        reason = branch_change(applied, current, bad)
        if reason is None:
            return
        if self.state.lost_branch(reason):
            self.stats.add_branch_change()
            self._bad.clear()
            self._reader.forget()
            self._floor = None
            self._watcher.rewound()
            logger.warning("deltasync rank=%d %s", self.rank, redact_text(reason))

    async def _stage(self, manifest: Manifest, below: Manifest | None) -> StagedStep[Any]:
        started = time.perf_counter()
        patches: list[Any] = []
        staging_s = 0.0  # spent in ``each``: not download time
        async for patch in self._guarded_iter(manifest):
            if self._each is None:
                patches.append(patch)
                continue
            t0 = time.perf_counter()
            try:
                patches.append(await self._staging(self._each, patch))
            except Exception as exc:
                exc.add_note("stage=stage")
                raise
            staging_s += time.perf_counter() - t0
            del patch
        downloaded = self._reader.selected_bytes(manifest, self._select)
        download_s = time.perf_counter() - started - staging_s
        kind = "anchor" if manifest.kind == "anchor" else "delta"
        self.stats.add_download(kind, downloaded, download_s)
        try:
            payload, nbytes = await self._staging(self._prepare, manifest, patches)
        except Exception as exc:
            exc.add_note("stage=stage")
            raise
        base_identity = None
        if manifest.kind == "delta":  # ``plan`` checked the link onto ``below``
            base_identity = below.identity if below is not None else None
        return StagedStep(manifest, payload, nbytes, downloaded, download_s,
                          base_identity=base_identity)

    async def _staging(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._stager, fn, *args)

    async def _guarded_iter(self, manifest: Manifest) -> Any:
        try:
            async for patch in self._reader.iter_patches(manifest, select=self._select):
                yield patch
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, IntegrityError) and await rewritten(self._reader, manifest):
                raise ChainError(
                    f"step {manifest.step} ({short_id(manifest.identity)}) was replaced in the "
                    "bucket while it was read (a trainer restart or another writer); planning "
                    "again") from exc
            exc.add_note("stage=download")
            exc.add_note(f"step={manifest.step}")
            raise

__all__ = ["Each", "Poller", "Prepare", "open_node_store"]

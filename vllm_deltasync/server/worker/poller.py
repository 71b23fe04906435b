"""The poller: one per rank, on its own asyncio loop in a daemon thread.

It discovers committed steps newer than what the rank has (``StepWatcher``), plans the chain
(``BucketReader.plan``), downloads and verifies the files holding the tensors this rank needs,
decodes them and hands each step's patches to a ``prepare`` callback (the extension translates
them to the rank's shards and moves them to the device). Prepared steps wait in a bounded
queue until the engine takes them. It never touches live parameters: the worker's main thread
applies what :meth:`Poller.take` returns, at a batch boundary.

Thread contract: :meth:`ready_steps`, :meth:`take`, :meth:`mark_applied`, :meth:`rewind`,
:meth:`reset` and :meth:`status` are called from the worker's main thread; everything else
runs on the loop.
No vLLM import here: tests drive it with a real ``file://`` bucket and a plain module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_deltasync._loop import BackgroundLoop
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import DeltaSyncError, FingerprintError, IntegrityError
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.manifest import Manifest
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.server.metrics import WorkerStats, error_reason
from vllm_deltasync.server.worker.discovery import StepWatcher

logger = logging.getLogger(__name__)

Prepare = Callable[[Manifest, list[TensorPatch]], tuple[Any, int]]
"""``prepare(manifest, patches) -> (payload, host_bytes)``: runs on a worker thread of the
poller; the payload is what :meth:`Poller.take` hands back to the applier."""


@dataclass
class StagedStep:
    """One step, downloaded, verified, decoded and prepared; ready to apply."""

    manifest: Manifest
    payload: Any
    nbytes: int
    downloaded_bytes: int
    download_s: float
    staged_at: float = field(default_factory=time.time)

    @property
    def step(self) -> int:
        return self.manifest.step


class Poller:
    """Follows a bucket for one rank; see the module docstring."""

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
    ) -> None:
        self.config = config
        self.rank = rank
        self.stats = stats or WorkerStats()
        self._prepare = prepare
        self._select = select
        self._reader = reader or BucketReader.open(
            config.url,
            store_options=config.store_options,
            max_concurrency=config.download_concurrency,
            fingerprint=fingerprint,
        )
        self._watcher = StepWatcher(
            self._reader.store,
            probe_interval_s=config.poll_interval_s,
            listing_interval_s=max(60.0, config.poll_interval_s),
            empty_listing_interval_s=config.poll_interval_s,
        )
        self._lock = threading.Lock()
        self._staged: list[StagedStep] = []
        self._applied = applied_step
        self._applied_manifest: Manifest | None = None
        self._applying: int | None = None
        self._generation = 0
        self._floor: int | None = None
        self._resync = False  # plan from an anchor although the applied step is known
        self._bad_steps: set[int] = set()  # a switch to these failed: never stage them again
        self.newest_step: int | None = None
        self.newest_published_at: float | None = None
        self.last_discovery_at: float | None = None
        self.last_error: str | None = None
        self._loop = BackgroundLoop(name=f"deltasync-poller-rank{rank}")
        self._room: asyncio.Event | None = None
        self._task: Any = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start following the bucket (returns at once)."""
        if self._task is None:
            self._task = self._loop.submit(self._main())

    def close(self) -> None:
        """Stop the loop thread; staged steps are dropped."""
        if self._task is not None:
            self._task.cancel()
        try:
            self._loop.run(self._reader.close(), timeout=10)
            self._loop.run(self._watcher.close(), timeout=10)
        except Exception:  # noqa: BLE001 - closing is best effort
            logger.debug("poller rank=%d: close failed", self.rank, exc_info=True)
        self._loop.close()
        with self._lock:
            self._staged.clear()

    # -------------------------------------------------------- worker main thread
    @property
    def applied_step(self) -> int | None:
        return self._applied

    @property
    def applied_manifest(self) -> tuple[int | None, Manifest | None]:
        """The applied step and its manifest (None when it came from ``loaded_step``)."""
        with self._lock:
            return self._applied, self._applied_manifest

    def ready_steps(self) -> list[int]:
        """Steps staged and ready, in apply order (each chains on the one before)."""
        with self._lock:
            return [s.step for s in self._staged]

    def take(self, upto: int) -> list[StagedStep]:
        """Remove and return the staged steps up to and including ``upto``, in order."""
        with self._lock:
            steps = [s.step for s in self._staged]
            if upto not in steps:
                raise DeltaSyncError(
                    f"rank {self.rank}: step {upto} is not staged (staged: {steps}); the engine "
                    "asked for a step this rank did not report ready"
                )
            cut = steps.index(upto) + 1
            taken, self._staged = self._staged[:cut], self._staged[cut:]
            self._applying = upto  # the chain tip while the worker writes (see _tip)
        self._signal_room()
        return taken

    def mark_applied(self, manifest: Manifest) -> None:
        """The worker applied ``manifest``: it is the new base of the chain."""
        with self._lock:
            self._applied = manifest.step
            self._applied_manifest = manifest
            if self._applying is not None and self._applying <= manifest.step:
                self._applying = None
            self._resync = False
            self._staged = [s for s in self._staged if s.step > manifest.step]

    def rewind(self, before: tuple[int | None, Manifest | None], failed: int, reason: str) -> None:
        """A switch to ``failed`` was taken back: the weights are ``before`` again.

        Staged steps are dropped and ``failed`` is never staged again; the next plan starts
        from an anchor (a fresh chain) while the applied step stays what the weights hold.
        """
        with self._lock:
            self._staged.clear()
            self._applied, self._applied_manifest = before
            self._applying = None
            self._resync = True
            self._bad_steps.add(failed)
            self._generation += 1
            self.last_error = reason
        self._signal_room()

    def reset(self, reason: str) -> None:
        """Forget the applied version (its weights are unknown now): next plan starts at an anchor."""
        with self._lock:
            self._staged.clear()
            self._applied = None
            self._applied_manifest = None
            self._applying = None
            self._generation += 1
            self.last_error = reason
        self._signal_room()

    def staged_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._staged)

    def status(self) -> dict[str, Any]:
        """The per-rank status dict (see ``metrics.py`` for the keys it feeds)."""
        with self._lock:
            staged = self._staged[-1].step if self._staged else None
            applied_m = self._applied_manifest
            staged_bytes = sum(s.nbytes for s in self._staged)
            ready = [s.step for s in self._staged]
        return {
            "rank": self.rank,
            "applied_step": self._applied,
            "staged_step": staged,
            "ready_steps": ready,
            "newest_step": self.newest_step,
            "applied_published_at": applied_m.created_at if applied_m else None,
            "newest_published_at": self.newest_published_at,
            "last_discovery_at": self.last_discovery_at,
            "staged_bytes": staged_bytes,
            "last_error": self.last_error,
            "bucket": self.config.redacted_url(),
            "counters": self.stats.snapshot(getattr(self._reader.store, "stats", None)),
        }

    # ------------------------------------------------------------- the loop
    def _signal_room(self) -> None:
        room = self._room
        if room is not None:
            with contextlib.suppress(RuntimeError):  # loop closed
                self._loop.loop.call_soon_threadsafe(room.set)

    def _tip(self) -> tuple[int | None, int]:
        """The step the next plan starts from (staged tail, else the step being applied), and
        the generation it belongs to: a plan made from it is dropped if a reset or rewind
        comes in between."""
        with self._lock:
            if self._staged:
                return self._staged[-1].step, self._generation
            if self._applying is not None:
                return self._applying, self._generation
            return (None if self._resync else self._applied), self._generation

    async def _main(self) -> None:
        self._room = asyncio.Event()
        if self.config.on_start == "wait":
            self._floor = await self._guarded(self._reader.latest_step(), "discover")
        while True:
            try:
                await self._round()
                self.last_error = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is reported, then retried
                self._report(exc)
                await asyncio.sleep(self.config.poll_interval_s)

    async def _guarded(self, coro: Any, stage: str) -> Any:
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            exc.add_note(f"stage={stage}")
            raise

    def _report(self, exc: BaseException) -> None:
        stage = _stage_of(exc)
        self.stats.add_failure(stage, exc)
        text = f"{error_reason(exc)}: {exc}"
        if text != self.last_error:
            logger.error("deltasync rank=%d %s failed: %s", self.rank, stage, text)
        self.last_error = text

    async def _round(self) -> None:
        tip, generation = self._tip()
        after = tip if self._floor is None or (tip is not None and tip > self._floor) else self._floor
        target = await self._guarded(
            self._watcher.wait_for_new(after=after, timeout_s=self.config.poll_interval_s),
            "discover",
        )
        self.last_discovery_at = time.time()
        if self._watcher.latest is not None and self._watcher.latest != self.newest_step:
            self.newest_step = self._watcher.latest
            newest = await self._guarded(self._reader.manifest(self.newest_step), "discover")
            self.newest_published_at = newest.created_at
        if target is None:
            return
        plan = await self._guarded(
            self._reader.plan(tip, target, max_chain=self.config.max_chain), "discover"
        )
        bad = sorted(self._bad_steps.intersection(m.step for m in plan))
        if bad:  # wait for an anchor newer than the step whose switch failed
            self._floor = max(target, self._floor or target)
            logger.warning("deltasync rank=%d: step %d is on a chain through step %d, whose "
                           "switch failed; waiting for a newer anchor", self.rank, target, bad[-1])
            return
        for manifest in plan:
            await self._wait_for_room()
            staged = await self._stage(manifest)
            with self._lock:
                if generation != self._generation:
                    return  # reset while staging: plan again from the new base
                self._staged.append(staged)
            logger.info(
                "deltasync staged step=%d kind=%s rank=%d bytes=%d in %.3fs",
                manifest.step, manifest.kind, self.rank, staged.downloaded_bytes, staged.download_s,
            )

    async def _wait_for_room(self) -> None:
        assert self._room is not None
        while True:
            with self._lock:
                used = sum(s.nbytes for s in self._staged)
                if not self._staged or used < self.config.max_staged_bytes:
                    return
                self._room.clear()
            await self._room.wait()

    async def _stage(self, manifest: Manifest) -> StagedStep:
        started = time.perf_counter()
        patches = [
            p async for p in self._guarded_iter(manifest)
        ]
        downloaded = _selected_bytes(manifest, self._select)
        download_s = time.perf_counter() - started
        kind = "anchor" if manifest.kind == "anchor" else "delta"
        self.stats.add_download(kind, downloaded, download_s)
        try:
            payload, nbytes = await asyncio.to_thread(self._prepare, manifest, patches)
        except Exception as exc:
            exc.add_note("stage=stage")
            raise
        return StagedStep(manifest, payload, nbytes, downloaded, download_s)

    async def _guarded_iter(self, manifest: Manifest) -> Any:
        try:
            async for patch in self._reader.iter_patches(manifest, select=self._select):
                yield patch
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            exc.add_note("stage=download")
            raise


def _selected_bytes(m: Manifest, select: Callable[[str], bool] | None) -> int:
    files = {c.file for t in m.tensors if select is None or select(t.name) for c in t.chunks}
    return sum(m.files[i].size for i in files)


def _stage_of(exc: BaseException) -> str:
    if isinstance(exc, IntegrityError):
        return "verify"
    if isinstance(exc, FingerprintError):
        return "discover"
    for note in reversed(getattr(exc, "__notes__", ()) or ()):
        if note.startswith("stage="):
            return note[len("stage="):]
    return "discover"


__all__ = ["Poller", "Prepare", "StagedStep"]

"""The one owner of a rank's sync state, shared by the poller thread and the worker's main thread.

Two threads work on a rank: the **poller thread** discovers, downloads, verifies, decodes and
prepares steps; the **worker's main thread** (vLLM's, between two model steps) writes them into
the live parameters when the engine core says so. Everything they share lives here, and only
here, behind one lock:

* the staged steps (:class:`StagedStep`, the typed hand-over from poller to main thread);
* the applied step and its manifest (whose identity a delta must name as its base), the step
  being written, the generation counter that voids plans made before a reset, rewind or branch
  change, the steps whose switch failed;
* whether the applied step is on a branch the bucket no longer continues (a trainer restarted
  from an older checkpoint, a second writer, a wiped bucket) until an anchor is applied;
* the last switch's :class:`PendingSwitch` (its undo) until the engine core commits or takes
  it back;
* what discovery last saw (newest step, its publish time), the last error, the last apply.

Every method takes the lock, so a status read made after a command returns always reflects that
command, and reading status never changes anything. The state never touches a parameter:
weights are written (and put back) by the main thread, which holds the undo only through the
:class:`PendingSwitch` it gets from here.

Nothing here knows where steps come from: today each rank's poller fills it; a node agent
could fill it just the same (it needs :meth:`SyncState.plan_base` and :meth:`SyncState.stage`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from vllm_deltasync.errors import DeltaSyncError
from vllm_deltasync.format.manifest import Manifest
from vllm_deltasync.server.messages import LastApply

P = TypeVar("P")
"""The prepared payload of a step: translated, device-resident pieces in the engine (a list of
:class:`~vllm_deltasync.server.worker.shardmap.Piece`); anything a ``prepare`` callback
returns in tests."""

Applied = tuple[int | None, Manifest | None]
"""The applied step and its manifest (None when it came from ``loaded_step``)."""


@dataclass(frozen=True)
class StagedStep(Generic[P]):
    """One step, downloaded, verified, decoded and prepared; ready to apply."""

    manifest: Manifest
    payload: P
    nbytes: int
    """Host/device bytes the payload holds."""
    downloaded_bytes: int
    download_s: float
    staged_at: float = field(default_factory=time.time)
    base_identity: str | None = None
    """A delta: the identity of the manifest it was planned onto (the step before it in the
    plan, or the applied one); it is written only onto weights of exactly that identity."""

    @property
    def step(self) -> int:
        return self.manifest.step


@dataclass(frozen=True)
class PendingSwitch:
    """A switch written on this rank and not yet committed by the engine core."""

    step: int
    undo: Any
    """:class:`~vllm_deltasync.server.worker.apply.Undo` of every piece written."""
    before: Applied
    """What the weights were before the switch."""


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of the state, read under the lock."""

    applied_step: int | None
    applied_id: str | None
    applied_published_at: float | None
    ready_steps: tuple[int, ...]
    ready_ids: tuple[str | None, ...]
    branch_lost: str | None
    staged_bytes: int
    newest_step: int | None
    newest_published_at: float | None
    last_discovery_at: float | None
    last_error: str | None
    last_apply: LastApply | None
    pending_switch: int | None


class SyncState(Generic[P]):
    """One rank's sync state; every method is safe from any thread (module docstring)."""

    def __init__(self, applied_step: int | None = None, *,
                 on_room: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._on_room = on_room
        self._staged: list[StagedStep[P]] = []
        self._applied: Applied = (applied_step, None)
        self._applying: Manifest | None = None
        self._branch: str | None = None
        self._generation = 0
        self._resync = False
        self._bad_steps: set[int] = set()
        self._pending: PendingSwitch | None = None
        self._failed: tuple[int, bool] | None = None
        self._newest: tuple[int | None, float | None] = (None, None)
        self._last_discovery_at: float | None = None
        self._poll_error: str | None = None  # written by the poller thread only
        self._switch_error: str | None = None  # written by the main thread only
        self._last_apply: LastApply | None = None

    def set_on_room(self, callback: Callable[[], None] | None) -> None:
        """Called (outside the lock) whenever staged steps are taken or dropped."""
        self._on_room = callback

    # ------------------------------------------------------------- poller thread
    def plan_base(self) -> tuple[Manifest | None, int]:
        """The manifest the next plan starts from (staged tail, else the step being written,
        else the applied step unless a resync through an anchor is due; None: unknown weights)
        and the generation it belongs to: :meth:`stage` drops a step planned in an older
        generation."""
        with self._lock:
            if self._staged:
                return self._staged[-1].manifest, self._generation
            if self._applying is not None:
                return self._applying, self._generation
            return (None if self._resync else self._applied[1]), self._generation

    def loaded_step(self) -> int | None:
        """The step number ``loaded_step`` claims for the loaded checkpoint, while its
        manifest (its identity) is not known yet; else None."""
        with self._lock:
            step, manifest = self._applied
            return step if manifest is None and not self._resync else None

    def adopt_loaded(self, manifest: Manifest | None, reason: str = "") -> bool:
        """Poller thread, once: the loaded checkpoint is ``manifest`` (the bucket's step
        ``loaded_step`` names); None: that step is not in the bucket, so the weights are
        unknown (resync through an anchor; ``reason`` says why). False when something else
        was applied meanwhile."""
        with self._lock:
            step, known = self._applied
            if known is not None or step is None or (manifest is not None and manifest.step != step):
                return False
            if manifest is None:
                self._applied = (None, None)
                self._switch_error = reason or None
            else:
                self._applied = (step, manifest)
            return True

    def lost_branch(self, reason: str) -> bool:
        """Poller thread: the applied step is on a branch the bucket no longer continues
        (its manifest there is gone or another). The weights stay as they are (and are
        reported as such) until an anchor of the bucket's chain is applied; staged steps are
        dropped, failed-step memory (step numbers of the old branch) forgotten. False when it
        was already known."""
        with self._lock:
            if self._branch == reason:
                return False
            self._branch = reason
            self._staged.clear()
            self._resync = True
            self._bad_steps.clear()
            self._generation += 1
        self._room()
        return True

    def branch_lost(self) -> str | None:
        with self._lock:
            return self._branch

    def applied_manifest(self) -> Manifest | None:
        with self._lock:
            return self._applied[1]

    def stage(self, generation: int, staged: StagedStep[P]) -> bool:
        """Add a prepared step; False (dropped) when a reset or rewind came in between."""
        with self._lock:
            if generation != self._generation:
                return False
            self._staged.append(staged)
            return True

    def staged_payloads(self) -> list[P]:
        """The payloads staged now (the poller thread counts their device bytes)."""
        with self._lock:
            return [s.payload for s in self._staged]

    def has_room(self, max_staged_bytes: int) -> bool:
        """True when another step may be staged (always when nothing is)."""
        with self._lock:
            return not self._staged or sum(s.nbytes for s in self._staged) < max_staged_bytes

    def failed_steps(self, steps: Iterable[int]) -> list[int]:
        """Those of ``steps`` whose switch failed on this engine (never staged again)."""
        with self._lock:
            return sorted(self._bad_steps.intersection(steps))

    def saw(self, newest_step: int | None, published_at: float | None) -> None:
        """Discovery looked at the bucket: the newest committed step and its publish time."""
        with self._lock:
            if newest_step is not None:
                self._newest = (newest_step, published_at)
            self._last_discovery_at = time.time()

    def newest_step(self) -> int | None:
        with self._lock:
            return self._newest[0]

    def set_poll_error(self, text: str | None) -> None:
        """The poller's last error (None: its last round went well). Kept apart from the
        switch error, so a good round never hides a failed switch."""
        with self._lock:
            self._poll_error = text

    def poll_error(self) -> str | None:
        with self._lock:
            return self._poll_error

    def set_switch_error(self, text: str | None) -> None:
        """Main thread: why the last switch was taken back (None once a switch succeeds)."""
        with self._lock:
            self._switch_error = text

    # ---------------------------------------------------------- worker main thread
    def ready_steps(self) -> list[int]:
        """Steps staged and ready, in apply order (each chains on the one before)."""
        with self._lock:
            return [s.step for s in self._staged]

    @property
    def applied(self) -> Applied:
        with self._lock:
            return self._applied

    @property
    def applied_step(self) -> int | None:
        with self._lock:
            return self._applied[0]

    def take(self, upto: int, *, rank: int = 0) -> list[StagedStep[P]]:
        """Remove and return the staged steps up to and including ``upto``, in order; from now
        until :meth:`mark_applied` (or a rewind/reset) ``upto`` is the base of the next plan."""
        with self._lock:
            steps = [s.step for s in self._staged]
            if upto not in steps:
                raise DeltaSyncError(
                    f"rank {rank}: step {upto} is not staged (staged: {steps}); the engine "
                    "asked for a step this rank did not report ready"
                )
            cut = steps.index(upto) + 1
            taken, self._staged = self._staged[:cut], self._staged[cut:]
            self._applying = taken[-1].manifest
        self._room()
        return taken

    def mark_applied(self, manifest: Manifest) -> str | None:
        """``manifest`` is written into the weights: it is the new base of the chain.

        Returns a line to report when this switch left a branch the trainer abandoned: an
        anchor of a restarted trainer (``resumed_from``) replaced steps after that checkpoint
        (a lost branch, already reported when the poller found it, is not reported twice)."""
        with self._lock:
            prior, _ = self._applied
            restart = None
            if (manifest.kind == "anchor" and manifest.resumed_from is not None
                    and prior is not None and prior > manifest.resumed_from
                    and self._branch is None):
                restart = (f"branch changed: the trainer restarted from its checkpoint of step "
                           f"{manifest.resumed_from} (anchor {manifest.step}); steps "
                           f"{manifest.resumed_from + 1}-{prior} applied before are abandoned")
            self._applied = (manifest.step, manifest)
            if self._applying is not None and self._applying.step <= manifest.step:
                self._applying = None
            if manifest.kind == "anchor":
                self._branch = None  # back on the chain the bucket holds
            self._resync = self._branch is not None
            self._staged = [s for s in self._staged if s.step > manifest.step]
        return restart

    def switched(self, pending: PendingSwitch, last_apply: LastApply) -> None:
        """A switch was written on this rank; its undo is kept until :meth:`commit`."""
        with self._lock:
            self._pending = pending
            self._failed = None
            self._switch_error = None
            self._last_apply = last_apply

    def switch_failed(self, step: int, reverted: bool, error: str) -> None:
        """This rank's own write of ``step`` failed; ``reverted``: it put its weights back."""
        with self._lock:
            self._pending = None
            self._failed = (step, reverted)
            self._switch_error = error

    def commit(self, step: int) -> bool:
        """The engine core made the switch to ``step`` final: drop its undo. True when that
        was the pending switch (False: nothing to commit, e.g. already committed)."""
        with self._lock:
            if self._pending is None or self._pending.step != step:
                return False
            self._pending = None
            return True

    def take_back(self, step: int) -> PendingSwitch | None:
        """Hand the pending switch to ``step`` to the main thread to revert (None when there is
        none to revert)."""
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is not None and pending.step != step:
                self._pending = pending
                return None
            return pending

    def already_reverted(self, step: int) -> bool:
        """This rank's own write of ``step`` failed and was put back already."""
        with self._lock:
            return self._failed == (step, True)

    def pending_step(self) -> int | None:
        with self._lock:
            return self._pending.step if self._pending is not None else None

    def rewind(self, before: Applied, failed: int, reason: str) -> None:
        """A switch to ``failed`` was taken back: the weights are ``before`` again. Staged
        steps are dropped and ``failed`` is never staged again; the next plan starts from an
        anchor while the applied step stays what the weights hold."""
        with self._lock:
            self._staged.clear()
            self._applied = before
            self._applying = None
            self._resync = True
            self._bad_steps.add(failed)
            self._generation += 1
            self._pending = None
            self._switch_error = reason
        self._room()

    def reset(self, reason: str) -> None:
        """Forget the applied version (the weights are unknown): the next plan starts at an
        anchor."""
        with self._lock:
            self._staged.clear()
            self._applied = (None, None)
            self._applying = None
            self._generation += 1
            self._pending = None
            self._switch_error = reason
        self._room()

    def drop_staged(self) -> None:
        """Drop what is staged (e.g. prepared with a shard map that was replaced since)."""
        with self._lock:
            self._staged.clear()
            self._generation += 1
        self._room()

    # ------------------------------------------------------------------- any thread
    def snapshot(self) -> Snapshot:
        with self._lock:
            applied_m = self._applied[1]
            return Snapshot(
                applied_step=self._applied[0],
                applied_id=applied_m.identity if applied_m is not None else None,
                applied_published_at=applied_m.created_at if applied_m is not None else None,
                ready_steps=tuple(s.step for s in self._staged),
                ready_ids=tuple(s.manifest.identity for s in self._staged),
                branch_lost=self._branch,
                staged_bytes=sum(s.nbytes for s in self._staged),
                newest_step=self._newest[0],
                newest_published_at=self._newest[1],
                last_discovery_at=self._last_discovery_at,
                last_error=self._switch_error or self._poll_error,
                last_apply=self._last_apply,
                pending_switch=self._pending.step if self._pending is not None else None,
            )

    def _room(self) -> None:
        callback = self._on_room
        if callback is not None:
            callback()


__all__ = ["Applied", "PendingSwitch", "Snapshot", "StagedStep", "SyncState"]

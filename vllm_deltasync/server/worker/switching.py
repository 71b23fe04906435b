"""A target's half of the switch on one rank: apply, commit, revert, put back.

The engine core's half is ``server/engine/switch.py``. :meth:`RankSwitch.apply` writes every
staged step up to the one the engine core chose and keeps the undo; :meth:`RankSwitch.commit`
drops it; :meth:`RankSwitch.revert` puts the weights back. Each answers an
:class:`~vllm_deltasync.server.messages.Outcome` the rank decides by itself, from what it did:
it knows whether it ever started writing a step (``applied``, ``nothing_written``,
``put_back``, ``unknown``). None of them raises an ``Exception``: vLLM's multiprocessing
executor stops reading the later ranks' answers at the first RPC that raises.

What is written and how it is put back is the target's :class:`Writer`, chosen by its row
(``Target.writer``): parameters written in place (``inplace.py``), or a new LoRA adapter version
registered with vLLM's LoRA manager (``adapters.py``). The switch is the same for both.

Runs on the worker's main thread, between two model steps (vLLM calls it through
``collective_rpc`` in the same FIFO as ``execute_model``).
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from vllm_deltasync import failpoints
from vllm_deltasync._urls import redact_text
from vllm_deltasync.errors import ApplyError, ChainError
from vllm_deltasync.format.reader import short_id
from vllm_deltasync.server.messages import (
    ApplyAnswer,
    CommitAnswer,
    CommitOutcome,
    LastApply,
    Outcome,
    RevertAnswer,
)
from vllm_deltasync.server.worker.state import Applied, PendingSwitch, StagedStep

if TYPE_CHECKING:
    from vllm_deltasync.server.worker.target import FollowedTarget

logger = logging.getLogger(__name__)


class Writer(Protocol):
    """How one target's rank writes its steps and puts them back (module doc)."""

    def check(self) -> None:
        """Before anything is written: :class:`ApplyError` when the target's weights were
        changed behind our back (the rank forgot its step: the switch answers unknown)."""

    def writing(self, step: int) -> AbstractContextManager[Any]:
        """Around the writes of a switch to ``step``: yields the undo that records them."""

    def write(self, staged: StagedStep[Any], undo: Any) -> int:
        """Write one staged step on top of what is written (``undo`` records it); the
        elements (or tensors) written. Raises with ``undo`` holding what was written."""

    def finish(self, step: int, taken: list[StagedStep[Any]], undo: Any) -> tuple[int, float]:
        """After every step is written: (layers repacked, seconds) for the kernels."""

    def put_back(self, undo: Any) -> bool:
        """Put back what ``undo`` recorded; True when anything had been written. Raises when
        it could not (the weights are unknown)."""

    def settled(self) -> None:
        """After writes or a put-back of ours (so they are not taken for writes behind our
        back)."""


class ApplyFailed(ApplyError):
    """A rank's apply failed; ``outcome`` says what its weights are now."""

    def __init__(self, message: str, *, outcome: Outcome) -> None:
        super().__init__(message)
        self.outcome = outcome


class RankSwitch:
    """The switch RPCs of one target on one rank (module doc)."""

    def __init__(self, owner: FollowedTarget) -> None:
        self.owner = owner
        self._writing: int | None = None
        """The step whose apply started here and has not answered (it escaped, or the test
        failpoint said so): the weights may be half written."""
        self._attempted: int | None = None
        """The last step whose apply started here."""

    def apply(self, step: int, identity: str | None = None) -> ApplyAnswer:
        """Between model steps: write every staged step up to ``step`` (``identity``, when
        given: the manifest the engine core chose; another one staged here is refused before
        anything is written). All or nothing on this rank: what a failure left written is put
        back. The switch stays pending (its undo kept) until :meth:`commit` or :meth:`revert`.

        Never raises an ``Exception``. A ``BaseException`` out of the write leaves the
        weights unknown: the rank forgets its step; ``KeyboardInterrupt`` and ``SystemExit``
        (the worker is going down) then propagate, anything else is answered."""
        self._attempted = self._writing = step
        try:
            done = self._apply(step, identity)
        except ApplyFailed as exc:
            out = self._failed(step, exc.outcome, exc)
        except BaseException as exc:
            out = self._failed(step, Outcome.UNKNOWN, exc)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
        else:
            out = ApplyAnswer(self.owner.rank, Outcome.APPLIED, done=done)
        self._writing = None
        return out

    def _failed(self, step: int, outcome: Outcome, exc: BaseException) -> ApplyAnswer:
        cause = exc.__cause__ if isinstance(exc, ApplyFailed) and exc.__cause__ else exc
        error = redact_text(f"{type(cause).__name__}: {cause}")
        if outcome is Outcome.UNKNOWN:
            self.owner.sync.reset(f"{error} (the weights are unknown)")
        logger.error("deltasync %s apply step=%d rank=%d failed (%s): %s", self.owner.name, step,
                     self.owner.rank, outcome.value, error, exc_info=cause)
        return ApplyAnswer(self.owner.rank, outcome, error=error)

    def _apply(self, step: int, identity: str | None) -> LastApply:
        writer = self.owner.writer
        if self.owner.refused is not None:
            raise ApplyFailed(f"rank {self.owner.rank} does not follow: {self.owner.refused}",
                              outcome=Outcome.NOTHING_WRITTEN)
        try:
            writer.check()
        except ApplyError as exc:  # the rank forgot its step: the weights are the reload's
            raise ApplyFailed(str(exc), outcome=Outcome.UNKNOWN) from exc
        before = self.owner.sync.applied
        started = time.perf_counter()
        written = 0
        with writer.writing(step) as undo:
            try:
                taken = self.owner.sync.take(step, rank=self.owner.rank)
                check_chain(self.owner.rank, before, taken, identity)  # before anything is written
                for staged in taken:
                    written += self._write_one(staged, undo)
                repacked, repack_s = writer.finish(step, taken, undo)
            except Exception as exc:
                self.owner.stats.add_failure("apply", exc)
                error = f"{type(exc).__name__}: {exc}"
                outcome = self._put_back(undo, before, step, error)
                self.owner.sync.switch_failed(step, outcome.as_before, error)
                writer.settled()
                raise ApplyFailed(str(exc), outcome=outcome) from exc
        writer.settled()
        done = LastApply(
            step=step, steps=tuple(s.step for s in taken),
            kinds=tuple(s.manifest.kind for s in taken),
            apply_s=time.perf_counter() - started, repacked_layers=repacked, repack_s=repack_s,
            written=written, downloaded_bytes=sum(s.downloaded_bytes for s in taken),
            staged_bytes=sum(s.nbytes for s in taken),
            changed=sum(s.manifest.totals.changed for s in taken),
            numel=taken[-1].manifest.totals.elements,
            published_at=taken[-1].manifest.created_at, at=time.time())
        self.owner.sync.switched(PendingSwitch(step, undo, before), done)
        return done

    def _write_one(self, staged: StagedStep[Any], undo: Any) -> int:
        t0 = time.perf_counter()
        n = self.owner.writer.write(staged, undo)
        restart = self.owner.sync.mark_applied(staged.manifest)
        if restart is not None:
            self.owner.stats.add_branch_change()
            logger.warning("deltasync %s rank=%d %s", self.owner.name, self.owner.rank, restart)
        kind = "anchor" if staged.manifest.kind == "anchor" else "delta"
        self.owner.stats.add_apply(kind, time.perf_counter() - t0, n)
        return n

    def commit(self, step: int) -> CommitAnswer:
        """The engine core made the switch to ``step`` final: drop its undo. Idempotent (the
        engine core sends it again while some rank reports the switch pending)."""
        try:
            fail = (self.owner.name, str(self.owner.rank), str(step))
            if fail in failpoints.armed("commit") and failpoints.once("commit", fail):
                raise RuntimeError(f"failpoint commit: rank {self.owner.rank} {self.owner.name} step {step}")
            done = self.owner.sync.commit(step)
        except Exception:  # noqa: BLE001 - answered, never raised (module doc)
            logger.exception("deltasync %s commit step=%d rank=%d failed", self.owner.name, step,
                             self.owner.rank)
            return CommitAnswer(self.owner.rank, CommitOutcome.FAILED)
        return CommitAnswer(self.owner.rank,
                            CommitOutcome.COMMITTED if done else CommitOutcome.NOT_PENDING)

    def revert(self, step: int, reason: str) -> RevertAnswer:
        """Take back this rank's switch to ``step`` (another rank, the engine core or the apply
        broadcast failed it). The rank decides from what it did: a pending switch is put
        back; its own failed apply was put back already; an apply of ``step`` that never
        started here wrote nothing (the step is dropped as on the other ranks and the rank
        waits for a newer anchor); an apply that started and never answered, or a put-back
        that failed, leaves the weights unknown (the rank forgets its step)."""
        try:
            return RevertAnswer(self.owner.rank, self._revert(step, reason))
        except Exception:  # noqa: BLE001 - answered, never raised (module doc)
            logger.exception("deltasync %s revert step=%d rank=%d failed", self.owner.name, step,
                             self.owner.rank)
            self.owner.sync.reset(f"{reason}; the revert failed")
            return RevertAnswer(self.owner.rank, Outcome.UNKNOWN)

    def _revert(self, step: int, reason: str) -> Outcome:
        if self._writing is not None:
            self.owner.sync.reset(f"{reason}; this rank's write of step {self._writing} never "
                            "answered: its weights are unknown")
            self._writing = None
            return Outcome.UNKNOWN
        pending = self.owner.sync.take_back(step)
        if pending is not None:
            try:
                return self._put_back(pending.undo, pending.before, step, reason)
            finally:
                self.owner.writer.settled()
        if self.owner.sync.already_reverted(step):
            self.owner.sync.set_switch_error(reason)
            return Outcome.PUT_BACK
        if self._attempted != step:
            self.owner.sync.rewind(self.owner.sync.applied, step, reason)
            logger.warning("deltasync %s rank %d never wrote step %d; dropped it: %s", self.owner.name,
                           self.owner.rank, step, reason)
            return Outcome.NOTHING_WRITTEN
        self.owner.sync.reset(f"{reason}; this rank holds no pending switch to step {step}")
        return Outcome.UNKNOWN

    def reset(self, reason: str) -> None:
        """Forget the applied version (the next step is reached through an anchor)."""
        self._writing = None
        self.owner.sync.reset(reason)

    def mark_writing(self, step: int) -> None:
        """Test failpoint ``apply_rpc`` with ``dirty``: as if an apply of ``step`` had started
        and never answered."""
        self._attempted = self._writing = step

    def _put_back(self, undo: Any, before: Applied, step: int, reason: str) -> Outcome:
        """Revert ``undo`` and rewind to ``before``; ``UNKNOWN`` (and a reset) when the weights
        could not be put back."""
        try:
            wrote = self.owner.writer.put_back(undo)
        except Exception as exc:  # noqa: BLE001 - reported: the weights are unknown now
            self.owner.sync.reset(f"{reason}; could not put the weights back: {exc}")
            return Outcome.UNKNOWN
        self.owner.sync.rewind(before, step, reason)
        return Outcome.PUT_BACK if wrote else Outcome.NOTHING_WRITTEN


def check_chain(rank: int, before: Applied, taken: list[StagedStep[Any]],
                 identity: str | None) -> None:
    """Identity, not numbers: each delta of ``taken`` must have been planned onto exactly the
    manifest below it (the applied one for the first), and the last step must be the one the
    engine core chose (``identity``). :class:`ChainError` before anything is written."""
    below = before[1]
    for staged in taken:
        m = staged.manifest
        if m.kind == "delta" and (below is None or below.identity is None
                                  or staged.base_identity != below.identity):
            held = "unknown weights" if below is None else (
                f"step {below.step} ({short_id(below.identity)})")
            raise ChainError(
                f"rank {rank}: step {m.step} was computed from step {m.base_step} "
                f"({short_id(staged.base_identity)}), the engine holds {held}; a delta is "
                "applied only onto the exact weights it was computed from")
        below = m
    last = taken[-1].manifest
    if identity is not None and last.identity != identity:
        raise ChainError(f"rank {rank}: step {last.step} staged here is "
                         f"{short_id(last.identity)}, the engine core chose "
                         f"{short_id(identity)}; not applied")


__all__ = ["ApplyFailed", "RankSwitch", "Writer", "check_chain"]

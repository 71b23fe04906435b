"""The writer of a target whose parameters are written in place (the policy, the drafter).

:class:`ParamWriter` is the :class:`~.switching.Writer` of a :class:`~.target.TargetRank`: it
writes a staged step's pieces into the live parameters (``apply.apply_patches``), recording
what it overwrote in an ``apply.Undo``; puts them back from it; repacks the CPU kernels of the
layers written (``packed.py``, or swaps in the ones packed ahead for that step); and notices
weights written behind our back before a switch (``TargetRank.check_reload``). The switch
itself (what is taken, the chain check, the outcomes) is ``switching.py``'s, the same for
every target.

Runs on the worker's main thread, between two model steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from vllm_deltasync import failpoints
from vllm_deltasync.errors import ApplyError
from vllm_deltasync.server.worker.state import StagedStep

if TYPE_CHECKING:
    from vllm_deltasync.server.worker.apply import Undo
    from vllm_deltasync.server.worker.target import TargetRank


class ParamWriter:
    """Writes one :class:`~.target.TargetRank`'s parameters in place (module doc)."""

    def __init__(self, owner: TargetRank) -> None:
        self.owner = owner
        self._prebuilt: Any = None

    def check(self) -> None:
        """vLLM's reload_weights (or any write but ours) may have replaced or rewritten
        parameters: then the map is derived again and the rank goes to an anchor
        (``TargetRank.check_reload``): ApplyError."""
        if self.owner.check_reload():
            raise ApplyError(f"rank {self.owner.rank}: the model's weights were changed outside "
                             "deltasync (reload_weights?); the shard map was rebuilt and the "
                             "engine resyncs through the next anchor")

    @contextlib.contextmanager
    def writing(self, step: int) -> Iterator[Undo]:
        """The kernels packed ahead for ``step`` are taken, and void for any other write from
        here (``writes.py``); yields the undo of the writes."""
        from vllm_deltasync.server.worker.apply import Undo

        self._prebuilt = self.owner.writes.take(step)
        with self.owner.writes.writing():
            yield Undo()

    def write(self, staged: StagedStep[Any], undo: Undo) -> int:
        """Write one staged step's pieces (test failpoint ``apply``: only some, then raise)."""
        from vllm_deltasync.server.worker.apply import apply_patches

        fail_after = self._apply_failpoint(staged.step)
        pieces = staged.payload if fail_after is None else staged.payload[:fail_after]
        n = apply_patches(pieces, undo)
        if fail_after is not None:
            raise ApplyError(f"rank {self.owner.rank}: failpoint apply at step {staged.step} after "
                             f"{len(pieces)} pieces")
        synchronize(staged.payload)
        return n

    def _apply_failpoint(self, step: int) -> int | None:
        """Test-only (``failpoints.py``, ``apply``): pieces to write before raising, once."""
        for args in failpoints.armed("apply"):
            if (args[:3] == (self.owner.name, str(self.owner.rank), str(step))
                    and failpoints.once("apply", args)):
                return int(args[3])
        return None

    def finish(self, step: int, taken: list[StagedStep[Any]], undo: Undo) -> tuple[int, float]:
        """Repack the CPU kernels of the layers written (or swap in those packed ahead for
        exactly this step): (layers repacked, seconds)."""
        t0 = time.perf_counter()
        params = [piece.param for piece, _ in undo.entries]
        prebuilt, self._prebuilt = self._prebuilt, None
        if prebuilt is not None and [s.step for s in taken] == [prebuilt.step]:
            repacked = self.owner.packed.swap(prebuilt, params)
        else:
            repacked = self.owner.packed.refresh(params)
        return repacked, time.perf_counter() - t0

    def put_back(self, undo: Undo) -> bool:
        """Every element written put back, bit for bit, and the kernels of those layers
        repacked; True when anything had been written. Raises when it could not."""
        pieces = [piece for piece, _ in undo.entries]
        with self.owner.writes.writing():
            undo.revert()
            synchronize(pieces)
            self.owner.packed.refresh(piece.param for piece in pieces)
        return bool(pieces)

    def settled(self) -> None:
        """Our own writes moved the parameters' version counters: remember the new ones."""
        self.owner.mark_written()


def synchronize(pieces: Iterable[Any]) -> None:
    """Wait for the device's writes of these pieces (a CUDA parameter's queue)."""
    first = next(iter(pieces), None)
    if first is not None and first.param.device.type == "cuda":
        torch.cuda.synchronize(first.param.device)


__all__ = ["ParamWriter", "synchronize"]

"""Our own writes to a target's weights, and the kernels packed ahead of them.

The worker's main thread writes the weights (a switch, a put-back, the proof's probe writes)
inside :meth:`Writes.writing`; the poller thread may pack the layers a staged delta touches
ahead of its switch (CPU build, ``server/worker/packed.py``) from the live weights, and hands
the result over with :meth:`Writes.offer`. A sequence counter, odd while a write is under way,
tells whether any write of ours came between the copies and the switch: kernels packed from
weights that changed since are never used.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class Writes:
    """One target's write sequence and the slot of the kernels packed ahead (module doc)."""

    def __init__(self, on_discard: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._on_discard = on_discard
        """Called when kernels packed ahead are thrown away (a write came between, or they
        were packed for another step)."""
        self.seq = 0
        """Odd while a write of ours is under way (main thread)."""
        self._depth = 0
        self._prebuilt: Any = None

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Main thread: around every write of ours (nested writes: only the outermost counts,
        a put-back runs inside the failed apply's write)."""
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self.seq += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self.seq += 1

    def offer(self, built: Any, seq: int, still_valid: Callable[[], bool]) -> bool:
        """Poller thread: keep ``built`` (packed from the weights at sequence ``seq``) for the
        next switch, if no write came since and ``still_valid()`` (checked under the lock)."""
        with self._lock:
            if self.seq == seq and still_valid():
                self._prebuilt = built
                return True
        self._on_discard()
        return False

    def take(self, step: int) -> Any:
        """Main thread, before a switch writes: what was packed ahead for ``step`` with no
        write of ours since, or None."""
        with self._lock:
            built, self._prebuilt = self._prebuilt, None
            if built is None:
                return None
            valid = built.step == step and built.seq == self.seq
        if not valid:
            self._on_discard()
            return None
        return built


__all__ = ["Writes"]

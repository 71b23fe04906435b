"""numba kernels: compiled once per process at first use, or None where numpy must do.

Every numba kernel of the package (the publisher's fused diff, sparse-v3's encoder and decoder)
is compiled here, the same way: numba is imported only inside :func:`compile_kernels`, never
when a module is imported (importing llvmlite in a process before an in-process vLLM engine
starts breaks that engine; docs/codec.md, tests/engine/test_inproc.py); ``njit(nogil=True,
cache=True)``, or without the disk cache where numba finds no writable cache directory; then
a self-check on a tiny input. numba missing gives None quietly; numba failing (no LLVM target,
a compile error, a wrong self-check) gives None and one warning line, and the caller runs its
numpy passes, which produce the same results.

::

    _KERNEL: list[Any] = []   # the slot: empty until decided, then [kernels or None]

    def _kernel() -> Any:   # the compiled function, or None
        return once(_KERNEL, lambda: first(compile_kernels(
            (_fused,), _check, log=logger, label="sparse-v3", what="the decoder",
            fallback="decoding with numpy (~1.5x slower)")))
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

LOCK = threading.RLock()
"""Held while a slot is decided (and by callers that set a slot themselves)."""


def compile_kernels(functions: Sequence[Callable[..., Any]], check: Callable[..., None], *,
                    log: logging.Logger, label: str, what: str, fallback: str) -> tuple[Any, ...] | None:
    """``functions`` compiled by numba, in order, after ``check(*compiled)`` returned; None
    where numba is not installed, or (with one warning line ``"<label>: numba could not
    compile <what> (<error>); <fallback>"``) where compiling or ``check`` raised."""
    try:
        import numba
    except ImportError:
        return None
    try:
        try:
            compiled = tuple(numba.njit(nogil=True, cache=True)(f) for f in functions)
        except RuntimeError:  # no writable cache location: compile in memory
            compiled = tuple(numba.njit(nogil=True)(f) for f in functions)
        check(*compiled)
    except Exception as exc:  # noqa: BLE001 - any numba failure leaves the numpy passes
        log.warning("%s: numba could not compile %s (%s: %s); %s", label, what,
                    type(exc).__name__, str(exc)[:200], fallback)
        return None
    return compiled


def first(compiled: tuple[Any, ...] | None) -> Any:
    """The one kernel of :func:`compile_kernels`' result, or None."""
    return None if compiled is None else compiled[0]


def once(slot: list[Any], decide: Callable[[], Any]) -> Any:
    """``slot[0]``, set by ``decide()`` at the first call in the process (one thread decides,
    the others wait for it). A caller empties the slot (``slot.clear()``) to decide again, or
    fills it (``slot[:] = [None]``, under :data:`LOCK`) to keep numba out."""
    if not slot:
        with LOCK:
            if not slot:
                slot.append(decide())
    return slot[0]


__all__ = ["LOCK", "compile_kernels", "first", "once"]

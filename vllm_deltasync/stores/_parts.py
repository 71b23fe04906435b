"""Parallel ranged reads with resume, shared by the network stores.

A backend supplies one primitive, :data:`FetchRange`: stream bytes ``[start, end)`` of an
object into a buffer as they arrive and return the object's total size when the answer says
it (``Content-Range``). When a connection drops mid-body the bytes already received stay in
the buffer and the next try asks only for the rest (``Range: bytes=<start+received>-``), so
a dropped connection never costs a re-download of what arrived.

Large objects are read as ``part_size`` pieces, ``max_parallel_parts`` at a time: object
stores and CDNs give ~50-100 MB/s per connection, so throughput comes from parallel ranges.

A read with ``max_bytes`` (``Store.read(..., max_bytes=)``, the manifest cap) asks for at most
``max_bytes + 1`` bytes first, refuses the object when the answer says it is larger, and stops
a body that brings more than that (a server ignoring ``Range``) while it streams:
:func:`too_large` is the error, shared with the local and memory stores.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from vllm_deltasync.errors import ConfigError, FormatError, TransientStoreError
from vllm_deltasync.stores._retry import RateGate, RetryPolicy, retry


def check_max_bytes(max_bytes: int | None) -> None:
    """``max_bytes`` of a read is None or an int >= 0 (a ConfigError otherwise)."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                  or max_bytes < 0):
        raise ConfigError(f"read max_bytes={max_bytes!r}: use a byte count >= 0, or None for no cap")


def too_large(what: str, max_bytes: int, size: int | None = None) -> FormatError:
    """The refusal of an object larger than the cap of a read (``size`` when it is known)."""
    found = f"{size} bytes" if size is not None else f"more than {max_bytes} bytes"
    return FormatError(
        f"{what}: {found}, over the {max_bytes}-byte cap of this read; refused without reading "
        "past the cap (not an object this reader accepts: check what wrote it)")


class Chunks:
    """Bytes of one range as they arrive, kept as a list (joined once at the end, no regrowth).

    With ``limit``, a chunk that takes the total past it raises :func:`too_large` (``what``
    names the object) and is not kept: the stream is stopped there."""

    __slots__ = ("limit", "parts", "size", "what")

    def __init__(self, limit: int | None = None, what: str = "") -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.limit = limit
        self.what = what

    def extend(self, chunk: bytes) -> None:
        if self.limit is not None and self.size + len(chunk) > self.limit:
            raise too_large(self.what, self.limit)
        self.parts.append(chunk)
        self.size += len(chunk)

    def __len__(self) -> int:
        return self.size


FetchRange = Callable[[int, "int | None", Chunks], Awaitable["int | None"]]
"""``fetch(start, end, buf)``: append bytes ``[start, end)`` (to the end when None) to ``buf``
while they arrive; return the object's total size if known. Raise ``TransientStoreError``
when the body is cut short (what arrived stays in ``buf``)."""


@dataclass
class RangedReader:
    """Reads one object range through ``fetch`` in parallel parts, resuming cut parts."""

    fetch: FetchRange
    what: str
    policy: RetryPolicy
    part_size: int
    max_parallel_parts: int
    gate: RateGate | None = None
    on_retry: Callable[[TransientStoreError], None] | None = None
    on_resume: Callable[[int], None] | None = None
    """Called with the number of bytes kept when a part resumes after a cut."""
    min_bytes_per_s: int | None = None
    """A part that receives fewer bytes than this per second over ``rate_window_s`` (and is not
    done) is cut and retried from where it stopped; None: no minimum rate."""
    rate_window_s: float = 30.0
    max_request_s: float | None = None
    """Longest one request for a part may take, however fast it is; None: no cap."""
    on_cut: Callable[[str], None] | None = None
    """Called with ``"slow"`` (below ``min_bytes_per_s``) or ``"timeout"`` (past
    ``max_request_s``, or not one byte over a rate window) when a request is cut, before it is
    retried (mirrors count why)."""

    async def read(self, start: int, end: int | None, max_bytes: int | None = None) -> bytes:
        """Bytes ``[start, end)``; with ``max_bytes``, :func:`too_large` when there are more
        (known from the first answer's ``Content-Range``, or while a body streams), having
        received at most ``max_bytes + 1`` bytes."""
        check_max_bytes(max_bytes)
        if end is not None and end <= start:
            return b""
        first_len = self.part_size if max_bytes is None else min(self.part_size, max_bytes + 1)
        first_end = start + first_len if end is None else min(end, start + first_len)
        first = Chunks(max_bytes, self.what)
        total = await self._part(start, first_end, first)
        if end is None:
            if total is None:  # full body answered (no Content-Range): it is all there
                return b"".join(first.parts)
            end = total
        stop = end if total is None else min(end, total)
        if max_bytes is not None and stop - start > max_bytes:
            raise too_large(self.what, max_bytes, None if total is None else total - start)
        if end <= start + len(first):
            return b"".join(first.parts)[: max(0, end - start)]
        rest = await self._rest(start + len(first), end)
        return b"".join([*first.parts, *(part for chunks in rest for part in chunks.parts)])

    async def _rest(self, start: int, end: int) -> list[Chunks]:
        bounds = [(a, min(a + self.part_size, end)) for a in range(start, end, self.part_size)]
        limiter = asyncio.Semaphore(self.max_parallel_parts)

        async def one(a: int, b: int) -> Chunks:
            async with limiter:
                buf = Chunks()
                await self._part(a, b, buf)
                return buf

        return list(await asyncio.gather(*(one(a, b) for a, b in bounds)))

    async def _part(self, start: int, end: int, buf: Chunks) -> int | None:
        async def attempt() -> int | None:
            if buf and self.on_resume is not None:
                self.on_resume(len(buf))
            if self.min_bytes_per_s is None and self.max_request_s is None:
                return await self.fetch(start + len(buf), end, buf)
            return await self._watched(self.fetch(start + len(buf), end, buf), buf)

        return await retry(
            attempt, what=self.what, policy=self.policy, gate=self.gate, on_retry=self.on_retry
        )


    async def _watched(self, fetch: Awaitable[int | None], buf: Chunks) -> int | None:
        """``fetch`` cut when too slow over a window or longer than ``max_request_s``."""
        task = asyncio.ensure_future(fetch)
        began = time.monotonic()
        deadline = None if self.max_request_s is None else began + self.max_request_s
        window = self.rate_window_s if self.min_bytes_per_s is not None else None
        mark = len(buf)
        try:
            while True:
                now = time.monotonic()
                waits = [w for w in (window, None if deadline is None else deadline - now) if w is not None]
                done, _ = await asyncio.wait({task}, timeout=max(0.0, min(waits)))
                if done:
                    return task.result()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self._cut("timeout")
                    raise TransientStoreError(
                        f"{self.what}: one request took longer than {self.max_request_s:g}s "
                        f"(max_request_s); retrying from byte {len(buf)} of the part")
                if window is not None and self.min_bytes_per_s is not None:
                    got = len(buf) - mark
                    if got < self.min_bytes_per_s * window:
                        self._cut("slow" if got else "timeout")  # nothing at all: a hang
                        raise TransientStoreError(
                            f"{self.what}: {got} bytes in {window:g}s, below the minimum "
                            f"{self.min_bytes_per_s} B/s (min_bytes_per_s); retrying the rest")
                    mark = len(buf)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _cut(self, why: str) -> None:
        if self.on_cut is not None:
            self.on_cut(why)


def parse_content_range(value: str | None) -> int | None:
    """Total size from ``Content-Range: bytes 0-99/1234`` (None when absent or ``*``)."""
    if not value or "/" not in value:
        return None
    total = value.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


def range_header(start: int, end: int | None) -> str:
    """``Range`` value for bytes ``[start, end)``."""
    return f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"


__all__ = ["Chunks", "FetchRange", "RangedReader", "check_max_bytes", "parse_content_range",
           "range_header", "too_large"]

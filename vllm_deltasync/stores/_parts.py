"""Parallel ranged reads with resume, shared by the network stores.

A backend supplies one primitive, :data:`FetchRange`: stream bytes ``[start, end)`` of an
object into a buffer as they arrive and return the object's total size when the answer says
it (``Content-Range``). When a connection drops mid-body the bytes already received stay in
the buffer and the next try asks only for the rest (``Range: bytes=<start+received>-``), so
a dropped connection never costs a re-download of what arrived.

Large objects are read as ``part_size`` pieces, ``max_parallel_parts`` at a time: object
stores and CDNs give ~50-100 MB/s per connection, so throughput comes from parallel ranges.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from vllm_deltasync.errors import TransientStoreError
from vllm_deltasync.stores._retry import RateGate, RetryPolicy, retry


class Chunks:
    """Bytes of one range as they arrive, kept as a list (joined once at the end, no regrowth)."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def extend(self, chunk: bytes) -> None:
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

    async def read(self, start: int, end: int | None) -> bytes:
        if end is not None and end <= start:
            return b""
        first_end = start + self.part_size if end is None else min(end, start + self.part_size)
        first = Chunks()
        total = await self._part(start, first_end, first)
        if end is None:
            if total is None:  # full body answered (no Content-Range): it is all there
                return b"".join(first.parts)
            end = total
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
            return await self.fetch(start + len(buf), end, buf)

        return await retry(
            attempt, what=self.what, policy=self.policy, gate=self.gate, on_retry=self.on_retry
        )


def parse_content_range(value: str | None) -> int | None:
    """Total size from ``Content-Range: bytes 0-99/1234`` (None when absent or ``*``)."""
    if not value or "/" not in value:
        return None
    total = value.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


def range_header(start: int, end: int | None) -> str:
    """``Range`` value for bytes ``[start, end)``."""
    return f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"


__all__ = ["Chunks", "FetchRange", "RangedReader", "parse_content_range", "range_header"]

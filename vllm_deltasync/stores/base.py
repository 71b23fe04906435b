"""The async interface every bucket backend implements.

A store is a flat namespace of immutable objects under one URL prefix. Paths passed to a store
are relative to that prefix and use ``/`` separators (``manifests/000000000042.json``). The
format layer (``format/layout.py``) decides the names; stores only move bytes.

Contract (checked by the conformance suite in ``tests/stores/``):

* ``write`` is atomic: a reader sees the whole object or nothing, never a prefix of it.
  It refuses to replace an existing path with :class:`AlreadyExistsError` unless
  ``overwrite=True`` (the format never needs to overwrite).
* ``list`` is recursive and returns objects sorted by path.
* ``read`` with ``start``/``end`` returns bytes ``[start, end)``; a missing path raises
  :class:`NotFoundError`; with ``max_bytes``, a larger range raises :class:`FormatError`
  without being read past the cap.
* ``delete`` ignores paths that do not exist.
* Errors are the classes of :mod:`vllm_deltasync.errors`; only ``TransientStoreError`` (and
  its subclass ``RateLimitedError``) is worth retrying.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_deltasync.errors import ConfigError


def check_path(path: str) -> str:
    """Reject paths that could leave the store's prefix."""
    parts = path.split("/")
    if (not path or path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts)
            or any(ord(c) < 32 or c == "\x7f" for c in path)):
        raise ConfigError(f"store path {path[:200]!r} must be relative, '/'-separated, without '.', "
                          "'..' or control characters")
    return path


@dataclass(frozen=True)
class ObjectInfo:
    """One object in a store."""

    path: str
    """Path relative to the store's prefix."""
    size: int
    """Size in bytes."""
    etag: str | None = None
    """A content identity if the backend has one (ETag, xetHash); None otherwise."""


@dataclass
class StoreStats:
    """Counters a store keeps about its own traffic (read by the metrics layer)."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    """(operation, outcome) -> count; outcome is ``ok``, ``not_found``, ``rate_limited``, ``error``."""
    bytes_read: int = 0
    bytes_written: int = 0
    mirror_requests: dict[tuple[str, str], int] = field(default_factory=dict)
    """(mirror base URL, outcome) -> count of reads tried on a mirror (``stores/mirrors.py``);
    outcome is ``ok``, ``not_found``, ``error``, ``timeout``, ``slow`` or ``corrupt``."""
    mirror_bytes_read: int = 0

    def count(self, op: str, outcome: str, n: int = 1) -> None:
        key = (op, outcome)
        self.requests[key] = self.requests.get(key, 0) + n

    def count_mirror(self, mirror: str, outcome: str) -> None:
        key = (mirror, outcome)
        self.mirror_requests[key] = self.mirror_requests.get(key, 0) + 1


class Store(abc.ABC):
    """An async object store rooted at one URL prefix."""

    #: URL scheme this backend serves (``file``, ``memory``, ``hf``, ``s3``).
    scheme: str = ""
    #: True where a create-only ``write`` is one atomic step, so that of two writers racing
    #: for one path exactly one succeeds and the other gets AlreadyExistsError (a publisher
    #: then need not read its commit back to learn who won).
    create_is_atomic: bool = False

    def __init__(self) -> None:
        self.stats = StoreStats()

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The store's URL with any credentials removed (safe to log)."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        """All objects whose path starts with ``prefix``, recursively, sorted by path."""

    @abc.abstractmethod
    async def stat(self, path: str) -> ObjectInfo | None:
        """The object at ``path``, or None if there is none. Cheap: used to probe for the next step."""

    @abc.abstractmethod
    async def read(
        self, path: str, start: int = 0, end: int | None = None, *, max_bytes: int | None = None
    ) -> bytes:
        """Bytes ``[start, end)`` of the object at ``path`` (to its end when ``end`` is None).

        ``max_bytes``: a cap enforced while reading (the manifest reader passes 64 MiB): when
        the range holds more, a :class:`~vllm_deltasync.errors.FormatError` naming the path
        and the cap is raised, and no more than ``max_bytes + 1`` bytes were read or held (a
        local file's size is checked before reading; a network body is stopped as it
        streams). Every backend must accept it; a store that wraps another passes it on.
        """

    @abc.abstractmethod
    async def write(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> None:
        """Store ``data`` at ``path`` atomically."""

    async def write_after(self, path: str, data: bytes | memoryview, ready: Awaitable[Any]) -> None:
        """Write ``data`` at ``path`` (create-only) once ``ready`` has completed, nothing if it
        raises (its error is raised): a step's manifest after its data files. This default
        awaits ``ready``, then writes; a store that can prepare the write meanwhile overrides
        it, never making ``path`` visible before ``ready`` has completed."""
        await ready
        await self.write(path, data)

    async def write_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """Write several objects; backends with a batch API override this. Order is not kept."""
        await asyncio.gather(*(self.write(path, data) for path, data in items))

    @abc.abstractmethod
    async def delete(self, paths: Sequence[str]) -> None:
        """Remove ``paths``; missing ones are ignored."""

    async def evict(self, path: str) -> bool:
        """Drop every local copy of ``path`` this store keeps (a cache), e.g. after its bytes
        failed a sha256 check, so that the next ``read`` fetches it from the bucket again.
        True if a copy was dropped; a store that keeps none returns False (this default)."""
        return False

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. The store must not be used afterwards."""

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

"""``memory://NAME`` buckets: a dict in this process, shared by every store opened with NAME.

For tests and demos. Objects are immutable ``bytes``; a lock makes writes atomic across
threads and event loops.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from vllm_deltasync.errors import AlreadyExistsError, ConfigError, NotFoundError
from vllm_deltasync.stores._parts import check_max_bytes, too_large
from vllm_deltasync.stores.base import ObjectInfo, Store, check_path

_BUCKETS: dict[str, dict[str, bytes]] = {}
_LOCK = threading.Lock()


class MemoryStore(Store):
    """A process-local bucket."""

    scheme = "memory"
    create_is_atomic = True

    def __init__(self, name: str) -> None:
        super().__init__()
        if not name:
            raise ConfigError("a memory bucket needs a name: memory://NAME")
        self.name = name
        with _LOCK:
            self._objects = _BUCKETS.setdefault(name, {})

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryStore:
        """``memory://NAME``."""
        if options:
            raise ConfigError(f"memory:// takes no options, got {sorted(options)}")
        return cls(url.split("://", 1)[1].strip("/") if "://" in url else url)

    @classmethod
    def drop(cls, name: str) -> None:
        """Forget the bucket ``name`` (tests)."""
        with _LOCK:
            _BUCKETS.pop(name, None)

    @property
    def url(self) -> str:
        return f"memory://{self.name}"

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        with _LOCK:
            items = [ObjectInfo(p, len(d)) for p, d in self._objects.items() if p.startswith(prefix)]
        self.stats.count("list", "ok")
        return sorted(items, key=lambda info: info.path)

    async def stat(self, path: str) -> ObjectInfo | None:
        with _LOCK:
            data = self._objects.get(check_path(path))
        self.stats.count("stat", "ok" if data is not None else "not_found")
        return None if data is None else ObjectInfo(path, len(data))

    async def read(
        self, path: str, start: int = 0, end: int | None = None, *, max_bytes: int | None = None
    ) -> bytes:
        check_max_bytes(max_bytes)
        with _LOCK:
            data = self._objects.get(check_path(path))
        if data is None:
            self.stats.count("read", "not_found")
            raise NotFoundError(f"{self.url}/{path}: no such object")
        size = len(range(len(data))[start:end])  # the slice's length, before copying it
        if max_bytes is not None and size > max_bytes:
            self.stats.count("read", "error")
            raise too_large(f"{self.url}/{path}", max_bytes, size)
        out = data[start:end]
        self.stats.count("read", "ok")
        self.stats.bytes_read += len(out)
        return out

    async def write(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> None:
        blob = bytes(data)
        with _LOCK:
            if not overwrite and check_path(path) in self._objects:
                self.stats.count("write", "error")
                raise AlreadyExistsError(f"{self.url}/{path} exists; bucket names are immutable")
            self._objects[path] = blob
        self.stats.count("write", "ok")
        self.stats.bytes_written += len(blob)

    async def delete(self, paths: Sequence[str]) -> None:
        with _LOCK:
            for path in paths:
                self._objects.pop(path, None)
        self.stats.count("delete", "ok", len(paths))

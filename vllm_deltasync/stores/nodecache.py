"""One download per node: a read-through cache the ranks of one engine on one node share.

Under tensor parallelism every rank needs every tensor, so ranks that each follow the bucket
alone fetch its bytes once per rank (measured: 2.00x at TP=2) and each run discovery. Bucket
objects are immutable (docs/format.md), so a node-local cache of them is always correct:

* **reads** (whole objects and byte ranges) go through ``<root>/objects/``: the first rank to
  need an object or range takes its lock file, downloads and writes it atomically; the others
  wait on the lock and read the local copy. A range inside a cached whole object is sliced
  from it. Ranks still verify every byte against the manifest's sha256s after reading.
* **discovery**: one rank per node is the *leader* (it holds ``<root>/leader.lock``). Only the
  leader asks the bucket what exists (``stat``, ``list``, the hf:// events feed) and records
  each answer that found something under ``<root>/seen/``; the other ranks' discovery answers
  from those records and the cached objects, with no request to the bucket. A follower sees a
  step at most one poll interval after the leader.

``root`` is per engine instance: ``<base>/<url hash>/<parent pid>`` (the ranks of one engine
on one node share their parent, the engine core or the node's launcher), so engines never see
each other's files and a reused bucket name cannot serve stale bytes. The leader deletes
objects nobody read for ``ttl_s`` seconds and the directories of engines that are gone.

Bytes cached are bounded by what the ranks read within ``ttl_s``; the cache lives in
``/dev/shm`` by default (RAM: count it in the node's memory budget, docs/extension.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_deltasync.errors import ConfigError
from vllm_deltasync.stores.base import ObjectInfo, Store, check_path

DEFAULT_BASE = "/dev/shm/vllm-deltasync"


def default_base() -> Path:
    """``/dev/shm/vllm-deltasync`` where ``/dev/shm`` exists, else the system temp folder."""
    shm = Path(DEFAULT_BASE)
    return shm if shm.parent.is_dir() else Path(tempfile.gettempdir()) / "vllm-deltasync"


def cache_root(base: Path, url: str, session: str | None = None) -> Path:
    """The directory the ranks of one engine on this node share for ``url``."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return base / digest / (session or str(os.getppid()))


class NodeCachedStore(Store):
    """``inner`` read through a node-local cache shared with the engine's other local ranks
    (see the module docstring). Read-only: servers never write to the bucket."""

    def __init__(self, inner: Store, root: Path, *, ttl_s: float = 600.0) -> None:
        super().__init__()
        self.inner = inner
        self.stats = inner.stats  # requests counted are the ones that reached the bucket
        self.scheme = inner.scheme
        self.root = root
        self.ttl_s = ttl_s
        for sub in ("objects", "seen", "locks"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self._leader_fd: int | None = os.open(root / "leader.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._leader_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._leader_fd)
            self._leader_fd = None
        self.leader = self._leader_fd is not None
        if self.leader and hasattr(inner, "changes"):
            self.changes = inner.changes  # only the leader watches the events feed
        self.cache_hits = 0
        self.cache_misses = 0
        self._last_prune = 0.0
        if self.leader:
            _remove_gone_sessions(root)

    @property
    def url(self) -> str:
        return self.inner.url

    # ---------------------------------------------------------------- reads
    async def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        check_path(path)
        whole = self._object(path, 0, None)
        data = _read_file(whole)
        if data is not None:
            self.cache_hits += 1
            return data[start:end] if (start, end) != (0, None) else data
        target = self._object(path, start, end)
        data = _read_file(target)
        if data is None:
            async with self._locked(target):
                data = _read_file(target)
                if data is None:
                    self.cache_misses += 1
                    data = await self.inner.read(path, start, end)
                    _write_atomic(target, data)
                    self._prune()
                    return data
        self.cache_hits += 1
        return data

    def _object(self, path: str, start: int, end: int | None) -> Path:
        suffix = "@all" if (start, end) == (0, None) else f"@{start}-{'' if end is None else end}"
        return self.root / "objects" / (path + suffix)

    @contextlib.asynccontextmanager
    async def _locked(self, target: Path) -> Any:
        name = hashlib.sha256(str(target).encode()).hexdigest()[:32]
        fd = os.open(self.root / "locks" / name, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    # ---------------------------------------------------------------- discovery
    async def stat(self, path: str) -> ObjectInfo | None:
        check_path(path)
        if self.leader:
            info = await self.inner.stat(path)
            if info is not None:
                self._record([info])
            return info
        return self._known(path)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        if self.leader:
            infos = await self.inner.list(prefix)
            self._record(infos)
            return infos
        return sorted(self._known_under(prefix), key=lambda o: o.path)

    def _record(self, infos: Sequence[ObjectInfo]) -> None:
        for info in infos:
            record = self.root / "seen" / (info.path + ".json")
            if not record.exists():
                _write_atomic(record, json.dumps({"size": info.size, "etag": info.etag}).encode())

    def _known(self, path: str) -> ObjectInfo | None:
        record = _read_file(self.root / "seen" / (path + ".json"))
        if record is not None:
            meta = json.loads(record)
            return ObjectInfo(path, int(meta["size"]), meta.get("etag"))
        whole = self._object(path, 0, None)
        if whole.is_file():  # read by some rank (e.g. the leader's manifest after an event)
            return ObjectInfo(path, whole.stat().st_size)
        return None

    def _known_under(self, prefix: str) -> Iterator[ObjectInfo]:
        seen: set[str] = set()
        for top, tail in ((self.root / "seen", ".json"), (self.root / "objects", "@all")):
            for f in _walk(top):
                rel = f.relative_to(top).as_posix()
                if not rel.endswith(tail):
                    continue
                path = rel[: -len(tail)]
                if path.startswith(prefix) and path not in seen:
                    info = self._known(path)
                    if info is not None:
                        seen.add(path)
                        yield info

    # ---------------------------------------------------------------- upkeep
    def _prune(self) -> None:
        """Leader: drop cached objects written more than ``ttl_s`` ago (at most every ttl/4)."""
        now = time.time()
        if not self.leader or now - self._last_prune < self.ttl_s / 4:
            return
        self._last_prune = now
        for f in _walk(self.root / "objects"):
            with contextlib.suppress(OSError):
                if now - f.stat().st_mtime > self.ttl_s:
                    f.unlink()

    async def write(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> None:
        raise ConfigError(f"{self.url}: a server's node cache is read-only")

    async def delete(self, paths: Sequence[str]) -> None:
        raise ConfigError(f"{self.url}: a server's node cache is read-only")

    async def close(self) -> None:
        try:
            await self.inner.close()
        finally:
            if self._leader_fd is not None:
                os.close(self._leader_fd)
                self._leader_fd = None


def _read_file(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _walk(top: Path) -> Iterator[Path]:
    for dirpath, _, files in os.walk(top):
        for name in files:
            if not name.startswith(".tmp-"):
                yield Path(dirpath) / name


def _remove_gone_sessions(root: Path) -> None:
    """Directories of engines whose parent process is gone (killed servers leave them)."""
    for sibling in root.parent.iterdir():
        if sibling == root or not sibling.name.isdigit():
            continue
        if not Path(f"/proc/{sibling.name}").exists():
            shutil.rmtree(sibling, ignore_errors=True)


__all__ = ["DEFAULT_BASE", "NodeCachedStore", "cache_root", "default_base"]

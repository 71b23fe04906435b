"""One download per node: a read-through cache the ranks of one engine on one node share.

Under tensor parallelism every rank needs every tensor, so ranks that each follow the bucket
alone fetch its bytes once per rank (measured: 2.00x at TP=2) and each run discovery. Bucket
objects are immutable (docs/format.md), so a node-local cache of them is always correct:

* **reads** of data objects (whole objects and byte ranges) go through ``<root>/objects/``: the
  first rank to need an object or range takes its lock file, downloads and writes it
  atomically; the others wait on the lock and read the local copy. A range inside a cached
  whole object is sliced from it. Ranks still verify every byte against the manifest's sha256s
  after reading; bytes that fail are dropped from the cache (:meth:`NodeCachedStore.evict`,
  called by ``format/reader.py``) and read once more from the bucket, so a corrupt cached copy
  never sticks.
* **manifests are never served from the cache**: a read under ``manifests/`` goes to the bucket
  every time. A manifest is small, and it is the root of trust: its sha256s are what every data
  byte is checked against, so a copy on local disk could vouch for forged data.
* **discovery**: one rank per node is the *leader* (it holds ``<root>/leader.lock``). Only the
  leader asks the bucket what exists (``stat``, ``list``, the hf:// events feed) and records
  each answer that found something under ``<root>/seen/`` (as does a rank that read a manifest
  whole); the other ranks' discovery answers from those records and the cached objects, with no
  request to the bucket. A follower sees a step at most one poll interval after the leader. A
  record that cannot be read or parsed counts as unknown, and the leader's next answer replaces
  it. Records only say that a path exists; its bytes are still read from the bucket.

``root`` is per engine instance: ``<base>/<url hash>/<parent pid>`` (the ranks of one engine
on one node share their parent, the engine core or the node's launcher), so engines never see
each other's files and a reused bucket name cannot serve stale bytes. The leader deletes
objects nobody read for ``ttl_s`` seconds and the directories of engines that are gone.

The cache is private to the user running the server: ``<base>``, ``<url hash>``, ``<root>`` and
the folders under it are created with mode 0700, and an existing ``<base>``, ``<url hash>`` or
``<root>`` (and ``objects``, ``seen``, ``locks``) must be a real directory (not a symbolic
link) owned by this user with no access for group or others, or the store refuses to start
with a :class:`~vllm_deltasync.errors.ConfigError` naming the path, what is wrong and the fix.
The default base is per user, ``/dev/shm/vllm-deltasync-<uid>``, so two users of one machine
never share (or pre-create) each other's cache.

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
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_deltasync.errors import ConfigError, FormatError
from vllm_deltasync.format.layout import MANIFEST_DIR
from vllm_deltasync.stores.base import ObjectInfo, Store, check_path

DEFAULT_BASE = "/dev/shm/vllm-deltasync"
"""Prefix of the default base; :func:`default_base` appends ``-<uid>`` (one per user)."""

_RANGE_SUFFIX = re.compile(r"all|[0-9]+-[0-9]*")


def default_base() -> Path:
    """``/dev/shm/vllm-deltasync-<uid>`` where ``/dev/shm`` exists, else
    ``<system temp folder>/vllm-deltasync-<uid>``: one base per user, never shared."""
    shm = Path(DEFAULT_BASE)
    name = f"{shm.name}-{os.getuid()}"
    return shm.parent / name if shm.parent.is_dir() else Path(tempfile.gettempdir()) / name


def cache_root(base: Path, url: str, session: str | None = None) -> Path:
    """The directory the ranks of one engine on this node share for ``url``."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return base / digest / (session or str(os.getppid()))


class NodeCachedStore(Store):
    """``inner`` read through a node-local cache shared with the engine's other local ranks
    (see the module docstring). Read-only: servers never write to the bucket.

    ``root`` is :func:`cache_root`'s ``<base>/<url hash>/<session>``: those three levels and
    ``objects``, ``seen``, ``locks`` under it are created private (0700) or checked to be, and
    :class:`ConfigError` refuses a level another user owns or may read or write, or a symlink.
    """

    def __init__(self, inner: Store, root: Path, *, ttl_s: float = 600.0) -> None:
        super().__init__()
        self.inner = inner
        self.stats = inner.stats  # requests counted are the ones that reached the bucket
        self.scheme = inner.scheme
        self.root = root
        self.ttl_s = ttl_s
        _private_tree(root, ("objects", "seen", "locks"))
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
        self.evictions = 0
        self._last_prune = 0.0
        if self.leader:
            _remove_gone_sessions(root)

    @property
    def url(self) -> str:
        return self.inner.url

    # ---------------------------------------------------------------- reads
    async def read(self, path: str, start: int = 0, end: int | None = None, *,
                   max_bytes: int | None = None) -> bytes:
        check_path(path)
        # a cap on what this read may return (the manifest reader's): passed on to the bucket
        capped: dict[str, Any] = {} if max_bytes is None else {"max_bytes": max_bytes}
        if path.startswith(MANIFEST_DIR + "/"):  # the root of trust: from the bucket, every time
            manifest = await self.inner.read(path, start, end, **capped)
            if (start, end) == (0, None):
                self._record([ObjectInfo(path, len(manifest))])  # followers' discovery knows it
            return manifest
        whole = self._object(path, 0, None)
        data = _read_file(whole)
        if data is not None:
            self.cache_hits += 1
            return self._capped(path, data[start:end] if (start, end) != (0, None) else data,
                                max_bytes)
        target = self._object(path, start, end)
        data = _read_file(target)
        if data is None:
            async with self._locked(target):
                data = _read_file(target)
                if data is None:
                    self.cache_misses += 1
                    data = await self.inner.read(path, start, end, **capped)
                    _write_atomic(target, data)
                    self._prune()
                    return data
        self.cache_hits += 1
        return self._capped(path, data, max_bytes)

    def _capped(self, path: str, data: bytes, max_bytes: int | None) -> bytes:
        if max_bytes is not None and len(data) > max_bytes:
            raise FormatError(f"{self.url}/{path}: {len(data)} bytes, over the {max_bytes}-byte "
                              "cap of this read")
        return data

    async def evict(self, path: str) -> bool:
        """Delete every cached copy of ``path`` (the whole object and each range), e.g. after
        its bytes failed a sha256 check: the next read fetches it from the bucket again (the
        inner store drops its own copies too: a mirror that served them is passed over)."""
        check_path(path)
        removed = await self.inner.evict(path)
        target = self._object(path, 0, None)
        name = target.name[: -len("all")]  # "<file name>@"
        try:
            entries = os.listdir(target.parent)
        except (FileNotFoundError, NotADirectoryError):
            return removed
        for entry in entries:
            if entry.startswith(name) and _RANGE_SUFFIX.fullmatch(entry[len(name):]):
                with contextlib.suppress(FileNotFoundError):  # another rank evicted it first
                    os.unlink(target.parent / entry)
                    removed = True
        if removed:
            self.evictions += 1
        return removed

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
        """Record what exists; a missing, garbage or differently sized record is (re)written."""
        for info in infos:
            record = self.root / "seen" / (info.path + ".json")
            known = _read_record(record)
            if known is None or known[0] != info.size:
                _write_atomic(record, json.dumps({"size": info.size, "etag": info.etag}).encode())

    def _known(self, path: str) -> ObjectInfo | None:
        record = _read_record(self.root / "seen" / (path + ".json"))
        if record is not None:
            return ObjectInfo(path, *record)
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


def _read_record(path: Path) -> tuple[int, str | None] | None:
    """(size, etag) of a discovery record; None when there is none or it is garbage (unreadable,
    not JSON, not an object with an integer ``size`` and a string or null ``etag``)."""
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(meta, dict):
        return None
    size, etag = meta.get("size"), meta.get("etag")
    if type(size) is not int or size < 0 or not (etag is None or isinstance(etag, str)):
        return None
    return size, etag


def _private_tree(root: Path, subdirs: Sequence[str]) -> None:
    """Create (mode 0700) or check ``<base>/<url hash>/<session>`` = ``root`` and ``subdirs``."""
    base = root.parent.parent
    for parent in reversed(base.parents):  # above the cache: create what is missing, no checks
        if not parent.is_dir():
            _mkdir_private(parent)
    for level in (base, root.parent, root, *(root / sub for sub in subdirs)):
        _private_dir(level)


def _mkdir_private(path: Path) -> bool:
    """Create ``path`` with mode 0700; False if something is there already."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return False
    except OSError as exc:
        raise ConfigError(f"node cache directory {path} cannot be created ({exc.strerror}); set "
                          "node_cache_dir (VLLM_DELTASYNC_NODE_CACHE_DIR) to a private directory "
                          "this user may create") from exc
    return True


def _private_dir(path: Path) -> None:
    """Create ``path`` with mode 0700, or check that the existing one is private: a directory,
    not a symbolic link, owned by this user, no access for group or others. ConfigError if not."""
    created = _mkdir_private(path)
    uid = os.getuid()
    try:  # O_NOFOLLOW: a symlink in its place is refused, never followed
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        problem = ("is a symbolic link" if os.path.islink(path)
                   else f"is not a directory this user can open ({exc.strerror})")
    else:
        try:
            if created:
                os.fchmod(fd, 0o700)  # whatever the umask took away
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if st.st_uid != uid:
            problem = f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
        elif st.st_mode & 0o077:
            problem = (f"has mode {st.st_mode & 0o777:04o}: other users may read or write it "
                       "(it must be 0700)")
        else:
            return
    raise ConfigError(
        f"node cache directory {path} {problem}; remove it, or set node_cache_dir "
        "(VLLM_DELTASYNC_NODE_CACHE_DIR) to a private directory (owned by uid "
        f"{uid}, mode 0700)")


def _makedirs(path: Path) -> None:
    """``path`` and its missing parents, mode 0700 (under the checked root)."""
    if path.is_dir():
        return
    _makedirs(path.parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    _makedirs(path.parent)
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

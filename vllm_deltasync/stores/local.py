"""``file://`` buckets: a local directory, the embedded default.

Writes go to a hidden temporary file in the target folder, are fsync'ed, then published
under the final name in one step (``os.link``, which refuses an existing name, or
``os.replace`` when overwriting is asked for), so a reader sees a whole object or nothing.
Blocking file calls run in the default thread pool.

A writer killed between the temporary file and the publish leaves the temporary file behind
(hidden from ``list``). The first write of every ``LocalStore`` removes temporary files that
have not changed for ``stale_temp_s`` (default 10 minutes: a live writer keeps its file's
mtime fresh), so the next publisher on the bucket cleans up after a killed one;
:meth:`LocalStore.remove_stale_temp` does it on demand.

What a hostile or broken directory may hold never hangs or crashes a reader: ``read`` opens
with ``O_NONBLOCK`` and refuses anything but a regular file (a FIFO, socket or device, also
behind a symlink such as ``-> /dev/zero``) with a :class:`StoreError` naming the path;
``max_bytes`` is checked against the file's size before a byte is read. ``list`` never
follows directory symlinks (a symlink cycle is not walked) and skips entries it cannot stat
(a symlink loop, a dangling link) or that are not regular files, with one log line per entry
per store. Any ``OSError`` of a read, write or listing (``ENOSPC``: disk full,
``EACCES``...) is a :class:`StoreError` naming the path.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import logging
import os
import secrets
import stat as stat_module
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from vllm_deltasync._urls import redact_url
from vllm_deltasync.errors import AlreadyExistsError, ConfigError, NotFoundError, StoreError
from vllm_deltasync.stores._parts import check_max_bytes, too_large
from vllm_deltasync.stores.base import ObjectInfo, Store, check_path

_TMP_PREFIX = ".tmp-"
_T = TypeVar("_T")
logger = logging.getLogger(__name__)


class LocalStore(Store):
    """A bucket in a local directory."""

    scheme = "file"

    def __init__(
        self, root: str | os.PathLike[str], *, fsync: bool = True, stale_temp_s: float = 600.0
    ) -> None:
        super().__init__()
        self.root = Path(root).expanduser().absolute()
        self.fsync = fsync
        self.stale_temp_s = stale_temp_s
        self._swept = False
        self.create_is_atomic = True  # until a filesystem without hard links is met
        self._reported: set[str] = set()
        """Entries a listing skipped and already logged (one log line each, not one a poll)."""

    def remove_stale_temp(self, older_than_s: float | None = None) -> list[str]:
        """Delete temporary files left by killed writers (unchanged for ``older_than_s``,
        default ``stale_temp_s``); returns their paths relative to the root."""
        limit = self.stale_temp_s if older_than_s is None else older_than_s
        cutoff = time.time() - limit
        removed: builtins.list[str] = []
        for dirpath, _, filenames in os.walk(self.root, followlinks=False):
            for name in filenames:
                if not name.startswith(_TMP_PREFIX):
                    continue
                full = Path(dirpath) / name
                try:
                    if full.stat().st_mtime <= cutoff:
                        full.unlink()
                        removed.append(str(full.relative_to(self.root)))
                except OSError:  # gone meanwhile, a symlink loop, no permission: not ours to fix
                    continue
        for rel in removed:
            _remove_empty_dirs((self.root / rel).parent, self.root)
        if removed:
            logger.info("%s: removed %d temporary file(s) left by a killed writer",
                        self.url, len(removed))
        return removed

    @classmethod
    def from_url(cls, url: str, **options: Any) -> LocalStore:
        """``file:///abs/dir``, ``file://rel/dir`` or a bare path."""
        rest = url.split("://", 1)[1] if "://" in url else url
        if not rest:
            raise ConfigError(f"bucket URL {redact_url(url)!r} names no directory; use file:///path/to/bucket")
        return cls(rest, **options)

    @property
    def url(self) -> str:
        return f"file://{self.root}"

    def _full(self, path: str) -> Path:
        return self.root / check_path(path)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await asyncio.to_thread(self._list, prefix)

    def _list(self, prefix: str) -> builtins.list[ObjectInfo]:
        if prefix.startswith("/") or ".." in prefix.split("/"):
            raise ConfigError(f"list prefix {prefix!r} must be relative, without '..'")
        found: builtins.list[ObjectInfo] = []
        top = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        # followlinks=False: a directory symlink (a cycle) is never walked into; errors of
        # a folder that cannot be read are skipped like the entries below
        for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith(_TMP_PREFIX):
                    continue
                rel = name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"
                if not rel.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # deleted while listing (or a dangling symlink)
                except OSError as exc:  # a symlink loop (ELOOP), no permission...
                    self._skip(rel, exc.strerror or type(exc).__name__)
                    continue
                if not stat_module.S_ISREG(st.st_mode):
                    self._skip(rel, f"not a regular file ({_kind(st.st_mode)})")
                    continue
                found.append(ObjectInfo(rel, st.st_size))
        found.sort(key=lambda info: info.path)
        self.stats.count("list", "ok")
        return found

    def _skip(self, rel: str, why: str) -> None:
        if rel not in self._reported:
            if len(self._reported) >= 4096:
                self._reported.clear()
            self._reported.add(rel)
            logger.warning("%s/%s: skipped by listing: %s", self.url, rel, why)

    async def stat(self, path: str) -> ObjectInfo | None:
        full = self._full(path)
        try:
            st = await asyncio.to_thread(os.stat, full)
        except (FileNotFoundError, NotADirectoryError):
            self.stats.count("stat", "not_found")
            return None
        except OSError as exc:  # a symlink loop, no permission
            self.stats.count("stat", "error")
            raise StoreError(f"{self.url}/{path}: cannot stat ({_reason(exc)})") from None
        self.stats.count("stat", "ok")
        return ObjectInfo(path, st.st_size)

    async def read(
        self, path: str, start: int = 0, end: int | None = None, *, max_bytes: int | None = None
    ) -> bytes:
        check_max_bytes(max_bytes)
        data = await asyncio.to_thread(self._read, path, start, end, max_bytes)
        self.stats.count("read", "ok")
        self.stats.bytes_read += len(data)
        return data

    def _read(self, path: str, start: int, end: int | None, max_bytes: int | None) -> bytes:
        full, where = self._full(path), f"{self.url}/{path}"
        try:
            # O_NONBLOCK: opening a FIFO does not wait for a writer (it is refused below)
            fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self.stats.count("read", "not_found")
            raise NotFoundError(f"{where}: no such object") from None
        except OSError as exc:  # a symlink loop, a socket (ENXIO), no permission
            self.stats.count("read", "error")
            raise StoreError(f"{where}: cannot open ({_reason(exc)})") from None
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fd)
            if not stat_module.S_ISREG(st.st_mode):
                self.stats.count("read", "error")
                if stat_module.S_ISDIR(st.st_mode):
                    raise NotFoundError(f"{where}: no such object (a directory)")
                raise StoreError(
                    f"{where}: not a regular file ({_kind(st.st_mode)}); refused: a bucket holds "
                    "only regular files, remove or replace it")
            stop = st.st_size if end is None else min(end, st.st_size)
            want = max(0, stop - start)
            if max_bytes is not None and want > max_bytes:
                self.stats.count("read", "error")
                raise too_large(where, max_bytes, want)
            try:
                fh.seek(start)
                # never more than the cap + 1, even if the file grew since fstat
                data = fh.read(want if max_bytes is None or end is not None else max_bytes + 1)
            except OSError as exc:
                self.stats.count("read", "error")
                raise StoreError(f"{where}: read failed ({_reason(exc)})") from None
        if max_bytes is not None and len(data) > max_bytes:
            self.stats.count("read", "error")
            raise too_large(where, max_bytes)
        return data

    async def write(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> None:
        await asyncio.to_thread(self._write, path, data, overwrite)
        self.stats.count("write", "ok")
        self.stats.bytes_written += len(data)

    def _write(self, path: str, data: bytes | memoryview, overwrite: bool) -> None:
        self._guarded(path, self._write_file, path, data, overwrite)

    def _guarded(self, path: str, op: Callable[..., _T], *args: Any) -> _T:
        """``op(*args)``, a step of writing ``path``: an ``OSError`` becomes a StoreError naming it."""
        try:
            return op(*args)
        except StoreError:
            raise
        except OSError as exc:  # ENOSPC (disk full), EDQUOT, EACCES, EROFS...
            self.stats.count("write", "error")
            hint = {errno.ENOSPC: "; the disk is full: free space or move the bucket",
                    errno.EDQUOT: "; the disk quota is exhausted",
                    errno.EROFS: "; the file system is read-only",
                    errno.EACCES: "; check the bucket folder's permissions"}.get(exc.errno or 0, "")
            raise StoreError(f"{self.url}/{path}: cannot write ({_reason(exc)}){hint}; "
                             "nothing was published under this name") from None

    def _write_file(self, path: str, data: bytes | memoryview, overwrite: bool) -> None:
        tmp, full = self._stage(path, data, overwrite)
        self._finish(tmp, full, path, overwrite)

    def _stage(self, path: str, data: bytes | memoryview, overwrite: bool) -> tuple[Path, Path]:
        """``data`` in a hidden temporary file beside ``path``, fsync'ed: (its path, the final one)."""
        if not self._swept:
            self._swept = True
            try:
                self.remove_stale_temp()
            except OSError as exc:  # best effort: never fail a write for it
                logger.warning("%s: could not remove stale temporary files: %s", self.url, exc)
        full = self._full(path)
        if not overwrite and full.exists():
            self.stats.count("write", "error")
            raise AlreadyExistsError(f"{self.url}/{path} exists; bucket names are immutable")
        full.parent.mkdir(parents=True, exist_ok=True)
        tmp = full.parent / f"{_TMP_PREFIX}{full.name}.{secrets.token_hex(6)}"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                if self.fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, full

    def _finish(self, tmp: Path, full: Path, path: str, overwrite: bool) -> None:
        """Publish the staged ``tmp`` as ``full`` (the temporary file is gone either way)."""
        try:
            self._publish(tmp, full, path, overwrite)
        finally:
            tmp.unlink(missing_ok=True)
        if self.fsync:
            _fsync_dir(full.parent)

    async def write_after(self, path: str, data: bytes | memoryview, ready: Awaitable[Any]) -> None:
        """The bytes are written to a temporary file and fsync'ed while ``ready`` runs; only
        the create-only link (and the folder's fsync) waits for it, so ``path`` never exists
        before ``ready`` has completed and nothing of it is left if ``ready`` raises. A subclass
        that overrides ``write`` gets the plain order (``ready``, then its ``write``)."""
        if type(self).write is not LocalStore.write:
            await super().write_after(path, data, ready)
            return
        staged = asyncio.ensure_future(asyncio.to_thread(self._guarded, path, self._stage, path, data, False))
        try:
            await ready
        except BaseException:
            with contextlib.suppress(Exception):  # its own error: ``ready``'s is the one raised
                tmp, _ = await staged
                tmp.unlink(missing_ok=True)
            raise
        tmp, full = await staged
        await asyncio.to_thread(self._guarded, path, self._finish, tmp, full, path, False)
        self.stats.count("write", "ok")
        self.stats.bytes_written += len(data)

    def _publish(self, tmp: Path, full: Path, path: str, overwrite: bool) -> None:
        if overwrite:
            os.replace(tmp, full)
            return
        try:
            os.link(tmp, full)
        except FileExistsError:
            self.stats.count("write", "error")
            raise AlreadyExistsError(f"{self.url}/{path} exists; bucket names are immutable") from None
        except OSError as exc:  # no hard links on this filesystem
            self.create_is_atomic = False  # a check and a rename: two writers may race
            if full.exists():
                raise AlreadyExistsError(f"{self.url}/{path} exists; bucket names are immutable") from exc
            os.replace(tmp, full)

    async def delete(self, paths: Sequence[str]) -> None:
        await asyncio.to_thread(self._delete, builtins.list(paths))

    def _delete(self, paths: builtins.list[str]) -> None:
        parents: set[Path] = set()
        for path in paths:
            full = self._full(path)
            try:
                full.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                self.stats.count("delete", "error")
                raise StoreError(f"{self.url}/{path}: cannot delete ({exc})") from exc
            parents.add(full.parent)
            self.stats.count("delete", "ok")
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            _remove_empty_dirs(parent, self.root)


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat_module.S_ISFIFO, "a FIFO"), (stat_module.S_ISSOCK, "a socket"),
                       (stat_module.S_ISCHR, "a character device"),
                       (stat_module.S_ISBLK, "a block device"), (stat_module.S_ISDIR, "a directory"),
                       (stat_module.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def _remove_empty_dirs(folder: Path, root: Path) -> None:
    while folder != root and root in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

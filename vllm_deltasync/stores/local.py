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
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_deltasync._urls import redact_url
from vllm_deltasync.errors import AlreadyExistsError, ConfigError, NotFoundError, StoreError
from vllm_deltasync.stores.base import ObjectInfo, Store, check_path

_TMP_PREFIX = ".tmp-"
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

    def remove_stale_temp(self, older_than_s: float | None = None) -> list[str]:
        """Delete temporary files left by killed writers (unchanged for ``older_than_s``,
        default ``stale_temp_s``); returns their paths relative to the root."""
        limit = self.stale_temp_s if older_than_s is None else older_than_s
        cutoff = time.time() - limit
        removed: builtins.list[str] = []
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                if not name.startswith(_TMP_PREFIX):
                    continue
                full = Path(dirpath) / name
                try:
                    if full.stat().st_mtime <= cutoff:
                        full.unlink()
                        removed.append(str(full.relative_to(self.root)))
                except FileNotFoundError:
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
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith(_TMP_PREFIX):
                    continue
                rel = name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"
                if not rel.startswith(prefix):
                    continue
                try:
                    size = os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    continue  # deleted while listing
                found.append(ObjectInfo(rel, size))
        found.sort(key=lambda info: info.path)
        self.stats.count("list", "ok")
        return found

    async def stat(self, path: str) -> ObjectInfo | None:
        full = self._full(path)
        try:
            st = await asyncio.to_thread(os.stat, full)
        except FileNotFoundError:
            self.stats.count("stat", "not_found")
            return None
        self.stats.count("stat", "ok")
        return ObjectInfo(path, st.st_size)

    async def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        data = await asyncio.to_thread(self._read, self._full(path), start, end)
        self.stats.count("read", "ok")
        self.stats.bytes_read += len(data)
        return data

    def _read(self, full: Path, start: int, end: int | None) -> bytes:
        try:
            with open(full, "rb") as fh:
                fh.seek(start)
                return fh.read() if end is None else fh.read(max(0, end - start))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self.stats.count("read", "not_found")
            raise NotFoundError(f"{self.url}/{full.relative_to(self.root)}: no such object") from None

    async def write(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> None:
        await asyncio.to_thread(self._write, path, data, overwrite)
        self.stats.count("write", "ok")
        self.stats.bytes_written += len(data)

    def _write(self, path: str, data: bytes | memoryview, overwrite: bool) -> None:
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
            self._publish(tmp, full, path, overwrite)
        finally:
            tmp.unlink(missing_ok=True)
        if self.fsync:
            _fsync_dir(full.parent)

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

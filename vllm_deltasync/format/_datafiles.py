"""Data files of one publish attempt: chunks packed into safetensors files of about
``max_file_bytes``, each written as soon as it is full (a few writes in flight).

The same chunks in the same order make the same bytes (safetensors' layout, its header
metadata in sorted order), and (format v2+) every chunk's role byte ranges and sha256 come
from the offsets the file was laid out with.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as save_safetensors

from vllm_deltasync._loop import BackgroundLoop
from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.layout import attempt_token, data_path
from vllm_deltasync.format.manifest import (
    FORMAT_NAME,
    Chunk,
    FileEntry,
    Kind,
    Region,
    RoleRange,
    merge_ranges,
)
from vllm_deltasync.stores import Store

MAX_WRITES_IN_FLIGHT = 4


@dataclass
class PendingChunk:
    """A chunk whose file is not written yet (v2 byte ranges and digest come at flush)."""

    owner: str
    keys: dict[str, str]
    start: int
    stop: int
    meta: dict[str, Any]
    region: Region | None
    file: int = -1
    roles: dict[str, RoleRange] = field(default_factory=dict)
    sha256: str | None = None

    def chunk(self) -> Chunk:
        if self.region is None:
            return Chunk(self.file, self.keys, self.start, self.stop, self.meta)
        return Chunk(self.file, self.keys, 0, self.stop - self.start, self.meta, self.region,
                     self.roles, self.sha256)


_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.bfloat16: "BF16", torch.int16: "I16",
           torch.uint8: "U8"}
"""The dtypes chunk roles have, in safetensors' order of data (its dtype order, descending)."""
_RANK = {name: rank for rank, name in enumerate(_DTYPES.values())}


def _save(tensors: dict[str, torch.Tensor], metadata: dict[str, str]
          ) -> tuple[bytes, dict[str, tuple[str, int, int]]]:
    """A safetensors file of ``tensors`` (1-D, contiguous) with ``metadata`` in sorted order,
    and where each key's bytes lie: key -> (dtype, offset from the file's start, length).

    The same bytes as safetensors' ``save`` (tensors ordered by dtype, then by key; the header
    padded with spaces to a multiple of 8) except that the metadata is sorted, so that the same
    step makes the same bytes (content-addressed stores deduplicate them; safetensors writes
    the metadata from a Rust HashMap, in an order that changes from file to file). Written
    here rather than by safetensors: the offsets are known without parsing the header back.
    Keys or dtypes the format never writes take safetensors' own ``save``."""
    if "__metadata__" in tensors or any(t.dtype not in _DTYPES for t in tensors.values()):
        return _save_by_safetensors(tensors, metadata)
    order = sorted(tensors, key=lambda k: (_RANK[_DTYPES[tensors[k].dtype]], k))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    pos = 0
    for key in order:
        t = tensors[key]
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    base = 8 + len(text)
    out = bytearray(base + pos)
    out[:8] = len(text).to_bytes(8, "little")
    out[8:base] = text
    body = np.frombuffer(out, dtype=np.uint8)
    where = {}
    for key in order:
        begin, end = header[key]["data_offsets"]
        if end > begin:
            body[base + begin : base + end] = tensors[key].reshape(-1).contiguous().view(torch.uint8).numpy()
        where[key] = (header[key]["dtype"], base + begin, end - begin)
    return bytes(out), where


def _save_by_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]
                         ) -> tuple[bytes, dict[str, tuple[str, int, int]]]:
    """``_save`` through safetensors' ``save``: its header parsed back for the offsets."""
    data = save_safetensors(tensors, metadata=metadata)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    text = json.dumps({"__metadata__": dict(sorted(meta.items())), **header},
                      separators=(",", ":")).encode()
    if len(text) <= n:  # else not the compact JSON safetensors writes: keep its bytes
        data = data[:8] + text + b" " * (n - len(text)) + data[8 + n :]
    final = json.loads(data[8 : 8 + n])  # as a reader parses it (a key may be "__metadata__")
    where = {key: (final[key]["dtype"], 8 + n + final[key]["data_offsets"][0],
                   final[key]["data_offsets"][1] - final[key]["data_offsets"][0])
             for key in tensors}
    return data, where


class DataFiles:
    """Packs chunk tensors into safetensors files and writes them as they fill up."""

    def __init__(self, store: Store, loop: BackgroundLoop, step: int, kind: Kind,
                 max_file_bytes: int, timeout_s: float, version: int, writer: str | None,
                 attempt: str | None = None, gate: Future[Any] | None = None) -> None:
        """``gate``: a check that must pass before anything is written (its error is then
        raised by every write, and nothing is written)."""
        self.store, self.loop, self.step, self.kind = store, loop, step, kind
        self.gate = gate
        self.max_file_bytes, self.timeout_s, self.version = max_file_bytes, timeout_s, version
        attempt = attempt or secrets.token_hex(8)
        self.token = attempt if writer is None else attempt_token(writer, attempt)
        self.entries: list[FileEntry] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.owners: set[str] = set()
        self.chunks: list[PendingChunk] = []
        self.size = 0
        self.pending: list[Future[None]] = []

    def add(self, owner: str, tensors: dict[str, torch.Tensor], chunk: PendingChunk) -> None:
        """Put one chunk's tensors (key -> tensor) in the current file; sets ``chunk.file``."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.tensors and self.size + nbytes > self.max_file_bytes:
            self.flush()
        if owner in self.owners:  # two chunks of one tensor: must not share storage in a file
            tensors = {k: t.clone() for k, t in tensors.items()}
        for key, tensor in tensors.items():
            if key in self.tensors:
                raise FormatError(f"step {self.step}: safetensors key {key!r} is used twice")
            self.tensors[key] = tensor
        self.owners.add(owner)
        self.size += nbytes
        chunk.file = len(self.entries)
        self.chunks.append(chunk)

    def flush(self) -> None:
        if not self.tensors:
            return
        meta = {"format": FORMAT_NAME, "schema_version": str(self.version),
                "step": str(self.step), "kind": self.kind}
        data, where = _save(self.tensors, meta)
        path = data_path(self.step, self.token, len(self.entries))
        # written while the digests are taken (and, for the last file, the manifest is built)
        self.pending.append(self.loop.submit(self._write(path, data)))
        index = _locate(data, where, self.chunks) if self.version >= 2 else None
        self.entries.append(FileEntry(path, len(data), hashlib.sha256(data).hexdigest(), index))
        self.tensors, self.owners, self.chunks, self.size = {}, set(), [], 0
        if len(self.pending) >= MAX_WRITES_IN_FLIGHT:
            self.pending.pop(0).result(self.timeout_s)

    async def _write(self, path: str, data: bytes) -> None:
        if self.gate is not None:
            await asyncio.wrap_future(self.gate)
        await self.store.write(path, data)

    async def written(self) -> None:
        """(On the loop) every write started, and the gate, completed; the first error is
        raised after all have ended (the gate's first)."""
        errors = []
        for future in ([self.gate] if self.gate is not None else []) + self.pending:
            try:
                await asyncio.wrap_future(future)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def finish(self) -> tuple[FileEntry, ...]:
        """Write the last file and wait for every write; the first error is raised."""
        try:
            self.flush()
        finally:
            self.wait()
        return tuple(self.entries)

    def wait_quietly(self) -> None:
        """Wait for every write started, ignoring their errors (another one is on its way)."""
        with contextlib.suppress(Exception):  # the caller raises its own error
            self.wait()

    def wait(self) -> tuple[FileEntry, ...]:
        """Wait for every write started (the last file too, once flushed); the first error is
        raised after all have ended."""
        errors = []
        for future in self.pending:
            try:
                future.result(self.timeout_s)
            except BaseException as exc:
                errors.append(exc)
        self.pending = []
        if errors:
            raise errors[0]
        return tuple(self.entries)


def _locate(data: bytes, where: dict[str, tuple[str, int, int]], chunks: list[PendingChunk]
            ) -> dict[str, tuple[tuple[int, int], ...]]:
    """v2: fill each chunk's role byte ranges and sha256 from the file (``where``: key ->
    dtype, offset, length); return the file index."""
    view = memoryview(data)
    ranges: dict[str, list[tuple[int, int]]] = {}
    for chunk in chunks:
        digest = hashlib.sha256()
        for role in sorted(chunk.keys):
            dtype, offset, length = where[chunk.keys[role]]
            rr = RoleRange(chunk.keys[role], dtype, offset, length)
            chunk.roles[role] = rr
            digest.update(view[offset : offset + length])
            ranges.setdefault(chunk.owner, []).append((offset, length))
        chunk.sha256 = digest.hexdigest()
    return {name: merge_ranges(rs) for name, rs in ranges.items()}


__all__ = ["MAX_WRITES_IN_FLIGHT", "DataFiles", "PendingChunk"]

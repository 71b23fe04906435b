"""Data files of one publish attempt: chunks packed into safetensors files of about
``max_file_bytes``, each written as soon as it is full (a few writes in flight).

The same chunks in the same order make the same bytes: safetensors' header metadata is
written in sorted order, and (format v2+) every chunk's role byte ranges and sha256 are read
back from the file's own header.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

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


def _save(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors' ``save`` with the header's metadata in sorted order, so that the same step
    makes the same bytes (content-addressed stores deduplicate them): safetensors writes the
    metadata from a Rust HashMap, in an order that changes from file to file."""
    data = save_safetensors(tensors, metadata=metadata)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    text = json.dumps({"__metadata__": dict(sorted(meta.items())), **header},
                      separators=(",", ":")).encode()
    if len(text) > n:  # not the compact JSON safetensors writes: keep its bytes
        return data
    return data[:8] + text + b" " * (n - len(text)) + data[8 + n :]


class DataFiles:
    """Packs chunk tensors into safetensors files and writes them as they fill up."""

    def __init__(self, store: Store, loop: BackgroundLoop, step: int, kind: Kind,
                 max_file_bytes: int, timeout_s: float, version: int, writer: str | None,
                 attempt: str | None = None) -> None:
        self.store, self.loop, self.step, self.kind = store, loop, step, kind
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
        data = _save(self.tensors, meta)
        path = data_path(self.step, self.token, len(self.entries))
        index = _locate(data, self.chunks) if self.version >= 2 else None
        self.entries.append(FileEntry(path, len(data), hashlib.sha256(data).hexdigest(), index))
        self.tensors, self.owners, self.chunks, self.size = {}, set(), [], 0
        self.pending.append(self.loop.submit(self.store.write(path, data)))
        if len(self.pending) >= MAX_WRITES_IN_FLIGHT:
            self.pending.pop(0).result(self.timeout_s)

    def finish(self) -> tuple[FileEntry, ...]:
        """Write the last file and wait for every write; the first error is raised."""
        try:
            self.flush()
        finally:
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


def _locate(data: bytes, chunks: list[PendingChunk]) -> dict[str, tuple[tuple[int, int], ...]]:
    """v2: fill each chunk's role byte ranges and sha256 from the file; return the file index."""
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    base = 8 + header_len
    view = memoryview(data)
    ranges: dict[str, list[tuple[int, int]]] = {}
    for chunk in chunks:
        digest = hashlib.sha256()
        for role in sorted(chunk.keys):
            info = header[chunk.keys[role]]
            begin, end = info["data_offsets"]
            rr = RoleRange(chunk.keys[role], info["dtype"], base + begin, end - begin)
            chunk.roles[role] = rr
            digest.update(view[rr.offset : rr.offset + rr.length])
            ranges.setdefault(chunk.owner, []).append((rr.offset, rr.length))
        chunk.sha256 = digest.hexdigest()
    return {name: merge_ranges(rs) for name, rs in ranges.items()}


__all__ = ["MAX_WRITES_IN_FLIGHT", "DataFiles", "PendingChunk"]

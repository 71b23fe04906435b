"""The writer's encode pool: the bucket gets the same bytes with any number of threads, uploads
start while later chunks encode, and encoded chunks waiting for their file stay bounded."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
import torch

from vllm_deltasync._loop import default_loop
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.format import _datafiles, writer
from vllm_deltasync.format.manifest import Region
from vllm_deltasync.format.writer import (
    StepFacts,
    StepItem,
    WriteOptions,
    encode_threads_for,
    write_files,
    write_step,
)
from vllm_deltasync.stores import memory, open_store

_NAMES = itertools.count()
_TOKEN = "0123456789abcdef"


def _items(seed: int = 0, *, blocks: bool = True) -> list[StepItem]:
    """Deltas of several tensors (one split into many chunks, one a block of a tensor, one empty)
    and a dense tensor."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for name, numel, density in [("big", 400_000, 0.05), ("small", 3000, 0.2), ("empty", 100, 0.0),
                                 ("mid", 60_000, 0.01)]:
        old = torch.randn(numel, generator=g).to(torch.bfloat16)
        idx = torch.nonzero(torch.rand(numel, generator=g) < density).flatten()
        new = (old[idx].view(torch.int16) + torch.randint(-3, 4, (idx.numel(),), generator=g)
               .to(torch.int16)).view(torch.bfloat16)
        items.append(StepItem(name, (numel,), idx.numel(), idx, new, old[idx]))
    old = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    block = Region(512 * 8, 32, 256, 512)  # rows 8..39, columns 0..255
    local = torch.nonzero(torch.rand(32 * 256, generator=g) < 0.1).flatten()
    flat = (local // 256 + 8) * 512 + local % 256
    base = old.view(-1)[flat]
    if blocks:  # format v2, v3 only
        items.append(StepItem("blocked", (64, 512), local.numel(), local,
                              (base.view(torch.int16) + 1).view(torch.bfloat16), base, block))
    items.append(StepItem("dense", (70_000,), 70_000, None, torch.randn(70_000, generator=g).to(torch.bfloat16), None))
    return items




def _publish(threads: int, monkeypatch: pytest.MonkeyPatch, *, codec: str = "sparse-v3",
             version: int = 3) -> dict[str, bytes]:
    monkeypatch.setattr(_datafiles.secrets, "token_hex", lambda n: _TOKEN[: 2 * n])
    monkeypatch.setattr(writer, "INLINE_ELEMENTS", 0)  # small as the step is: through the pool
    monkeypatch.setattr(writer.time, "time", lambda: 1234.5)
    name = f"threads-{next(_NAMES)}"
    store = open_store(f"memory://{name}")
    facts = StepFacts(1, "delta", 0, 0, "sha256:" + "0" * 64, (10, 10), base_id="sha256:" + "ab" * 32 if version >= 2 else None)
    options = WriteOptions(codec, max_file_bytes=16 << 10, timeout_s=60, version=version,
                           run_id=_TOKEN if version >= 2 else None,
                           writer=_TOKEN if version >= 2 else None, encode_threads=threads)
    write_step(store, default_loop(), facts, _items(blocks=version >= 2), options)
    return dict(memory._BUCKETS.pop(name))


@pytest.mark.parametrize(("codec", "version"), [("sparse-v3", 3), ("sparse-v3", 2), ("sparse-v2-zstd", 3),
                                                ("sparse-v2", 1)])
def test_any_thread_count_writes_the_same_bytes(codec: str, version: int, monkeypatch: pytest.MonkeyPatch) -> None:
    one = _publish(1, monkeypatch, codec=codec, version=version)
    assert sum(k.startswith("data/") for k in one) >= 6  # several files: packing is exercised
    for threads in (2, 3, 8, 0):
        assert _publish(threads, monkeypatch, codec=codec, version=version) == one, threads


def test_encode_threads_option() -> None:
    assert encode_threads_for(3) == 3
    assert 1 <= encode_threads_for(0) <= writer.MAX_ENCODE_THREADS
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="encode_threads"):
            encode_threads_for(bad)  # type: ignore[arg-type]


def test_uploads_start_while_chunks_encode_and_waiting_chunks_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many chunks of one tensor through 2 threads: the first file is written before the last
    chunk is encoded, and at most ``2 * threads`` encoded chunks ever wait for their file."""
    lock = threading.Lock()
    counts = {"encoded": 0, "added": 0, "max_waiting": 0}
    encoded_at_first_write: list[int] = []
    real_encode, real_add = writer._encode_chunk, _datafiles.DataFiles.add

    def encode(*args: Any) -> Any:
        out = real_encode(*args)
        with lock:
            counts["encoded"] += 1
            counts["max_waiting"] = max(counts["max_waiting"], counts["encoded"] - counts["added"])
        return out

    def add(self: Any, *args: Any) -> None:
        real_add(self, *args)
        with lock:
            counts["added"] += 1

    store = open_store(f"memory://threads-{next(_NAMES)}")
    real_write = store.write

    async def write(path: str, data: bytes) -> Any:
        with lock:
            encoded_at_first_write.append(counts["encoded"])
        return await real_write(path, data)

    monkeypatch.setattr(writer, "_encode_chunk", encode)
    monkeypatch.setattr(_datafiles.DataFiles, "add", add)
    monkeypatch.setattr(store, "write", write)
    g = torch.Generator().manual_seed(1)
    n = 2_000_000
    idx = torch.nonzero(torch.rand(4 * n, generator=g) < 0.25).flatten()
    old = torch.randn(idx.numel(), generator=g).to(torch.bfloat16)
    new = (old.view(torch.int16) + 1).view(torch.bfloat16)
    item = StepItem("t", (4 * n,), idx.numel(), idx, new, old)
    files, _ = write_files(store, default_loop(), StepFacts(1, "delta", 0, 0, "fp", (1, 4 * n)), [item],
                           WriteOptions("sparse-v3", max_file_bytes=60_000, timeout_s=60,
                                        writer=_TOKEN, encode_threads=2))
    chunks = counts["encoded"]
    assert chunks >= 40 and len(files) >= 10
    assert encoded_at_first_write[0] < chunks  # the first upload began before the last encode
    assert counts["max_waiting"] <= 2 * 2

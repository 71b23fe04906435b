"""Chunks of a file are verified and decoded on a thread pool (``BucketReader.decode_threads``):
the same patches, in the same order, as one after another; a corrupt chunk still fails the step
with its tensor named."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from vllm_deltasync import DeltaPublisher
from vllm_deltasync.errors import IntegrityError
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.stores import open_store


def _publish(root: Path) -> str:
    gen = torch.Generator().manual_seed(0)
    base = {f"layer.{i}.weight": torch.randn(64, 96, generator=gen).to(torch.bfloat16)
            for i in range(12)}
    after = {n: t.clone() for n, t in base.items()}
    for t in after.values():
        t.view(torch.int16).reshape(-1)[::37] += 1
    url = f"file://{root}/bucket"
    with DeltaPublisher(url) as pub:
        pub.publish(0, base)
        pub.publish(1, after)
        pub.flush()
    return url


def _patches(url: str, threads: int, step: int) -> list[tuple[str, bytes, bytes]]:
    async def go() -> list[tuple[str, bytes, bytes]]:
        reader = BucketReader(open_store(url), decode_threads=threads)
        try:
            m = await reader.manifest(step)
            out = []
            async for p in reader.iter_patches(m):
                idx = b"" if p.indices is None else p.indices.numpy().tobytes()
                out.append((p.name, idx, p.values.view(torch.int16).numpy().tobytes()))
            return out
        finally:
            await reader.close()

    return asyncio.run(go())


def test_threads_decode_the_same_patches_in_the_same_order(tmp_path: Path) -> None:
    url = _publish(tmp_path)
    for step in (0, 1):
        one = _patches(url, 1, step)
        assert len(one) == 12
        assert _patches(url, 4, step) == one


def test_a_corrupt_chunk_fails_with_threads_too(tmp_path: Path) -> None:
    """Ranged path (not every tensor selected): each chunk verified by its own sha256."""
    url = _publish(tmp_path)

    async def go() -> None:
        reader = BucketReader(open_store(url), decode_threads=4)
        try:
            m = await reader.manifest(1)
            entry = m.tensor("layer.5.weight")
            assert entry is not None and entry.chunks[0].roles is not None
            chunk = entry.chunks[0]
            role = next(iter(chunk.roles.values()))
            target = tmp_path / "bucket" / m.files[chunk.file].path
            raw = bytearray(target.read_bytes())
            raw[role.offset] ^= 0xFF
            target.chmod(0o644)
            target.write_bytes(bytes(raw))
            with pytest.raises(IntegrityError, match="tensor 'layer.5.weight'"):
                async for _ in reader.iter_patches(m, select=lambda n: n != "layer.0.weight"):
                    pass
        finally:
            await reader.close()

    asyncio.run(go())

"""Helpers for the codec and TRL-import tests (no engine, no network)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

SPECIAL_BITS = [
    0x0000,  # +0.0
    0x8000,  # -0.0
    0x7F80,  # +inf
    0xFF80,  # -inf
    0x7FC0,  # quiet NaN
    0x7F81,  # signalling NaN payload
    0xFFFF,  # negative NaN, all payload bits
    0x0001,  # smallest subnormal
    0x7F7F,  # largest finite
]


def bits_to_bf16(bits: list[int] | torch.Tensor) -> torch.Tensor:
    """uint16 bit patterns (Python ints or int tensor) -> bf16 tensor with exactly those bits."""
    t = torch.as_tensor(bits, dtype=torch.int64) if not isinstance(bits, torch.Tensor) else bits
    return (t.to(torch.int64) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16)


def trl_file(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    return save(tensors, metadata=meta)


def trl_delta_meta(step: int, changed: list[str], total: int, nnz: int) -> dict[str, str]:
    """Header metadata as TRL's delta sync writes it."""
    return {
        "format": "sparse_weight_patch",
        "version": "1",
        "sparse": "true",
        "model_version": str(step),
        "sparsity": f"{1 - nnz / total:.6f}",
        "changed_params": json.dumps(changed),
        "total_params": str(total),
        "changed_elements": str(nnz),
    }


def header_metadata(data: bytes) -> dict[str, str]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]).get("__metadata__") or {}


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def publish_and_read_back(tmp_path: Path, codec: str, *, format_version: int = 3) -> Path:
    """Five steps of a trainer publishing with ``codec`` through the real publisher to a file://
    bucket (anchor every 3rd), read back by the real reader: steps 2 and 4 (deltas, written with
    ``codec`` only) must equal the trainer's tensors bit for bit. Returns the bucket directory."""
    from vllm_deltasync._loop import run_sync
    from vllm_deltasync.format.reader import BucketReader
    from vllm_deltasync.trainer.publisher import DeltaPublisher

    gen = torch.Generator().manual_seed(0)
    url = f"file://{tmp_path}/bucket"
    w = {"a": torch.randn(64, 48, generator=gen).to(torch.bfloat16),
         "b": torch.randn(3000, generator=gen).to(torch.bfloat16)}
    states = []
    with DeltaPublisher(url, codec=codec, anchor_every=3, format_version=format_version) as pub:
        for step in range(5):
            for t in w.values():
                flat = t.view(-1).view(torch.int16)
                pick = torch.randint(0, flat.numel(), (flat.numel() // 20,), generator=gen)
                flat[pick] += 1
            pub.publish(step, w)
            states.append({k: v.clone() for k, v in w.items()})

    async def read(step: int) -> dict[str, torch.Tensor]:
        async with BucketReader.open(url) as reader:
            m = await reader.manifest(step)
            assert m.kind == "delta" and {t.encoding for t in m.tensors} == {codec}
            return await reader.read_full(step)

    for step in (2, 4):
        got = run_sync(read(step))
        for k, v in states[step].items():
            assert torch.equal(got[k].view(torch.int16), v.view(torch.int16)), (step, k)
    return tmp_path / "bucket"

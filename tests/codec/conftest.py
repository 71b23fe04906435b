"""Helpers for the codec and TRL-import tests (no engine, no network)."""

from __future__ import annotations

import json
import struct

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

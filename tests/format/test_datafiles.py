"""The writer lays data files out itself (format/_datafiles.py ``_save``): the bytes are
safetensors' own layout with sorted metadata, every file loads with safetensors, and the
offsets it reports are where each key's bytes are."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load

from vllm_deltasync.format import _datafiles

DTYPES = [torch.int64, torch.int32, torch.bfloat16, torch.int16, torch.uint8]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in range(rng.randint(1, 12)):
        dtype = rng.choice(DTYPES)
        n = rng.choice([0, 1, 3, 7, 64, 1000])
        name = rng.choice(["w", "model.layers.0.mlp", "é.ü", "a@1048576", "z"]) + f".{k}.values"
        raw = torch.randint(-100, 100, (n,), generator=g)
        out[name] = raw.to(torch.float32).to(dtype) if dtype == torch.bfloat16 else raw.to(dtype)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_the_layout_is_safetensors_with_sorted_metadata(seed: int) -> None:
    tensors = _tensors(seed)
    meta = {"step": "3", "kind": "delta", "format": "vllm-deltasync", "schema_version": "3"}
    data, where = _datafiles._save(tensors, meta)
    ours = (data, where)
    theirs = _datafiles._save_by_safetensors(tensors, meta)
    if all(k.isascii() for k in tensors):  # safetensors escapes nothing; the re-dump would
        assert ours == theirs
    loaded = load(data)
    assert loaded.keys() == tensors.keys()
    for key, t in tensors.items():
        assert torch.equal(loaded[key].view(torch.uint8), t.view(torch.uint8)), key
        dtype, offset, length = where[key]
        assert data[offset : offset + length] == t.view(torch.uint8).numpy().tobytes()
    assert _datafiles._save(tensors, dict(reversed(list(meta.items()))))[0] == data  # deterministic


def test_unusual_keys_and_dtypes_go_through_safetensors() -> None:
    odd = {"x": torch.zeros(3, dtype=torch.float32)}
    assert _datafiles._save(odd, {"a": "b"}) == _datafiles._save_by_safetensors(odd, {"a": "b"})

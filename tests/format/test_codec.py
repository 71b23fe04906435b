"""Codecs: round trips, registry, and refusal of malformed payloads."""

from __future__ import annotations

import pytest
import torch

from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.codecs import decode_chunk, get_codec
from vllm_deltasync.format.manifest import Chunk, TensorEntry


def sparse_case(numel: int = 1000, k: int = 37, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randperm(numel, generator=gen)[:k].sort().values
    new = torch.randn(k, generator=gen).to(torch.bfloat16)
    old = torch.randn(k, generator=gen).to(torch.bfloat16)
    return indices, new, old


def test_sparse_v1_is_the_trl_layout_and_round_trips() -> None:
    codec = get_codec("sparse-v1")
    indices, new, old = sparse_case()
    roles, meta = codec.encode(indices, new, old)
    assert roles["indices"].dtype == torch.int32 and roles["values"].dtype == torch.bfloat16
    assert codec.key("w", "indices", 0) == "w.indices" and codec.key("w", "values", 5) == "w.values@5"
    got_idx, got_val, relative = codec.decode(roles, meta, len(indices))
    assert not relative and torch.equal(got_idx, indices) and torch.equal(got_val.view(torch.int16), new.view(torch.int16))


def test_dense_round_trip() -> None:
    codec = get_codec("dense")
    values = torch.randn(50).to(torch.bfloat16)
    roles, meta = codec.encode(None, values, None)
    idx, got, relative = codec.decode(roles, meta, 50)
    assert idx is None and not relative and torch.equal(got, values)
    assert codec.key("w", "values", 0) == "w"


def test_unknown_encoding_is_a_format_error() -> None:
    with pytest.raises(FormatError, match="encoding 'sparse-v99' is unknown"):
        get_codec("sparse-v99")


def entry(numel: int, chunk: Chunk, encoding: str = "sparse-v1") -> TensorEntry:
    return TensorEntry("w", (numel,), "bfloat16", encoding, chunk.count, (chunk,))


def test_decode_chunk_checks_keys_dtypes_bounds_and_order() -> None:
    indices, new, old = sparse_case()
    chunk = Chunk(0, {"indices": "w.indices", "values": "w.values"}, 0, len(indices))
    good = {"w.indices": indices.to(torch.int32), "w.values": new}
    patch = decode_chunk(entry(1000, chunk), chunk, good, source="f")
    assert torch.equal(patch.indices, indices)  # type: ignore[arg-type]
    cases = {
        "missing": {"w.values": new},
        "dtype": {"w.indices": indices.to(torch.int64), "w.values": new},
        "length": {"w.indices": indices[:-1].to(torch.int32), "w.values": new[:-1]},
        "range": {"w.indices": (indices + 1000).to(torch.int32), "w.values": new},
        "order": {"w.indices": indices.flip(0).to(torch.int32), "w.values": new},
    }
    for label, tensors in cases.items():
        with pytest.raises(FormatError, match="'w'"):
            decode_chunk(entry(1000, chunk), chunk, tensors, source=f"file-{label}")


@pytest.mark.parametrize("codec_name", ["sparse-v1", "sparse-v2"])
def test_codec_patch_applies_exactly(codec_name: str) -> None:
    try:
        codec = get_codec(codec_name)
    except FormatError:
        pytest.skip(f"{codec_name} is not available")
    base = torch.randn(1000).to(torch.bfloat16)
    indices, new, _ = sparse_case()
    roles, meta = codec.encode(indices, new, base[indices])
    idx, values, relative = codec.decode(roles, meta, len(indices))
    target = base.clone()
    TensorPatch("w", (1000,), idx, values, relative=relative).apply_to(target)
    expected = base.clone()
    expected[indices] = new
    assert torch.equal(target.view(torch.int16), expected.view(torch.int16))


def test_relative_patch_wraps_mod_2_16() -> None:
    flat = torch.tensor([0x7FFF, -0x8000, 5], dtype=torch.int16).view(torch.bfloat16)
    diffs = torch.tensor([1, -1, -10], dtype=torch.int16)
    TensorPatch("w", (3,), torch.tensor([0, 1, 2]), diffs, relative=True).apply_to(flat)
    assert flat.view(torch.int16).tolist() == [-0x8000, 0x7FFF, -5]
    dense = torch.zeros(4, dtype=torch.bfloat16)
    TensorPatch("w", (4,), None, torch.ones(2, dtype=torch.bfloat16), offset=1).apply_to(dense)
    assert dense.tolist() == [0, 1, 1, 0]

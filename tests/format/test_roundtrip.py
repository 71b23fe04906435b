"""Every codec reconstructs the new tensor bit for bit, whatever the shape, density and values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.helpers.codec import bits_to_bf16, deltas, publish_and_read_back
from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.codecs import get_codec
from vllm_deltasync.format.sparse_v2 import SparseV2Codec

SPARSE = {
    "sparse-v1": get_codec("sparse-v1"),
    "sparse-v2": get_codec("sparse-v2"),
    "sparse-v2-zstd": get_codec("sparse-v2-zstd"),
    # the torch ops GPUs run, exercised on the CPU
    "sparse-v2/torch": SparseV2Codec(cpu_kernels="torch"),
    "sparse-v2-zstd/torch": SparseV2Codec(compression="zstd", cpu_kernels="torch"),
}


def _roundtrip(codec_key: str, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    codec = SPARSE[codec_key]
    idx = torch.nonzero(old.view(torch.int16) != new.view(torch.int16)).flatten()
    roles, meta = codec.encode(idx, new[idx], old[idx])
    assert all(t.dim() == 1 for t in roles.values())
    indices, values, relative = codec.decode(roles, meta, idx.numel())
    assert indices is not None and indices.dtype == torch.int64
    assert torch.equal(indices, idx)
    out = old.clone()
    TensorPatch("t", tuple(old.shape), indices, values, relative=relative).apply_to(out)
    return out


@pytest.mark.parametrize("codec_key", sorted(SPARSE))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=deltas())
def test_sparse_roundtrip_is_bit_exact(codec_key: str, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    old, new = pair
    out = _roundtrip(codec_key, old, new)
    assert torch.equal(out.view(torch.int16), new.view(torch.int16))


@settings(max_examples=40, deadline=None)
@given(pair=deltas())
def test_dense_roundtrip_is_bit_exact(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    _, new = pair
    codec = get_codec("dense")
    roles, meta = codec.encode(None, new, None)
    indices, values, relative = codec.decode(roles, meta, new.numel())
    out = torch.zeros_like(new)
    TensorPatch("t", tuple(new.shape), indices, values, relative=relative).apply_to(out)
    assert torch.equal(out.view(torch.int16), new.view(torch.int16))


@settings(max_examples=40, deadline=None)
@given(pair=deltas())
def test_v2_without_base_stores_raw_values(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    old, new = pair
    codec = SPARSE["sparse-v2"]
    idx = torch.nonzero(old.view(torch.int16) != new.view(torch.int16)).flatten()
    roles, meta = codec.encode(idx, new[idx], None)
    indices, values, relative = codec.decode(roles, meta, idx.numel())
    assert not relative and values.dtype == torch.bfloat16 and meta["values"] == "raw"
    assert torch.equal(values.view(torch.int16), new[idx].view(torch.int16))


@pytest.mark.parametrize("codec_key", sorted(SPARSE))
@pytest.mark.parametrize("bits", [(0x8000, 0x0000), (0x7FC0, 0x7F80), (0x0000, 0xFFFF), (0xFF80, 0x7F7F)])
def test_single_element(codec_key: str, bits: tuple[int, int]) -> None:
    old, new = bits_to_bf16([bits[0]]), bits_to_bf16([bits[1]])
    out = _roundtrip(codec_key, old, new)
    assert out.view(torch.int16).item() == new.view(torch.int16).item()


@pytest.mark.parametrize("codec_key", ["sparse-v2", "sparse-v2-zstd", "sparse-v2/torch"])
def test_large_gaps_and_far_indices(codec_key: str) -> None:
    """Gaps beyond 2**32 (a chunk of a huge tensor) and values far from the base."""
    codec = SPARSE[codec_key]
    idx = torch.tensor([5, 2**33 + 7, 2**40 + 1, 2**40 + 2, 2**40 + 300], dtype=torch.int64)
    new = bits_to_bf16([1, 2, 3, 0xFFFF, 0x4000])
    old = bits_to_bf16([0, 0, 0, 0x7FFF, 0x3FFF])
    roles, meta = codec.encode(idx, new, old)
    assert meta["gap_escapes"] >= 2
    indices, values, _ = codec.decode(roles, meta, 5)
    assert torch.equal(indices, idx)
    assert torch.equal((old.view(torch.int16) + values), new.view(torch.int16))


@pytest.mark.parametrize("codec_key", ["sparse-v2", "sparse-v2/torch", "sparse-v2-zstd/torch"])
def test_escapes_of_both_kinds(codec_key: str, gen: torch.Generator) -> None:
    """Sparse positions (gaps over 255) and a few far moves among +-1 steps."""
    n = 200_000
    idx = torch.nonzero(torch.rand(n, generator=gen) < 0.01).flatten()
    old = torch.randint(0, 1 << 16, (idx.numel(),), generator=gen)
    step = torch.where(torch.rand(idx.numel(), generator=gen) < 0.02,
                       torch.randint(8, 30000, (idx.numel(),), generator=gen), 1)
    old_bf, new_bf = bits_to_bf16(old), bits_to_bf16(old + step)
    codec = SPARSE[codec_key]
    roles, meta = codec.encode(idx, new_bf, old_bf)
    assert meta["gap_escapes"] > 0 and meta["value_escapes"] > 0 and meta["values"] == "diff4"
    indices, values, relative = codec.decode(roles, meta, idx.numel())
    assert relative and torch.equal(indices, idx)
    assert torch.equal(old_bf.view(torch.int16) + values, new_bf.view(torch.int16))


def test_v2_is_compact_on_small_steps(gen: torch.Generator) -> None:
    """1% of 1M elements moved by one or two ulps: well under 2 bytes per changed element."""
    n = 1 << 20
    idx = torch.randperm(n, generator=gen)[: n // 100].sort().values
    old = (torch.randn(idx.numel(), generator=gen) * 0.02).to(torch.bfloat16)
    step = torch.randint(1, 3, (idx.numel(),), generator=gen).to(torch.int16)
    new = (old.view(torch.int16) + step).view(torch.bfloat16)
    for key, limit in (("sparse-v2", 1.7), ("sparse-v2-zstd", 1.35)):
        roles, _ = SPARSE[key].encode(idx, new, old)
        nbytes = sum(t.numel() * t.element_size() for t in roles.values())
        assert nbytes / idx.numel() < limit, key


def test_v2_rejects_corrupt_frames_and_meta(gen: torch.Generator) -> None:
    codec = SPARSE["sparse-v2-zstd"]
    idx = torch.arange(0, 1000, 7)
    old = torch.randn(idx.numel(), generator=gen).to(torch.bfloat16)
    new = (old.float() * 1.01).to(torch.bfloat16)
    roles, meta = codec.encode(idx, new, old)
    broken = roles["data"].clone()
    broken[len(broken) // 2 :] ^= 0x5A
    with pytest.raises(FormatError):
        codec.decode({"data": broken}, meta, idx.numel())
    with pytest.raises(FormatError, match="gap_bits"):
        codec.decode(roles, {**meta, "gap_bits": 12}, idx.numel())
    with pytest.raises(FormatError, match="meta"):
        codec.decode(roles, {k: v for k, v in meta.items() if k != "first"}, idx.numel())
    with pytest.raises(FormatError, match="role"):
        codec.decode(roles, meta, idx.numel() + 1)
    plain, plain_meta = SPARSE["sparse-v2"].encode(idx, new, old)
    with pytest.raises(FormatError, match="'gaps'"):
        SPARSE["sparse-v2"].decode({k: v for k, v in plain.items() if k != "gaps"}, plain_meta, idx.numel())
    with pytest.raises(FormatError, match="strictly increasing"):
        codec.encode(idx.flip(0), new, old)


@pytest.mark.parametrize("codec", ["sparse-v2", "sparse-v3"])
def test_publisher_and_reader_carry_the_codec(tmp_path: Path, codec: str) -> None:
    """End to end through the real publisher and reader on a file:// bucket."""
    publish_and_read_back(tmp_path, codec)

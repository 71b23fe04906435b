"""bf16 bit patterns and the codec cases more than one codec test draws from: special values,
``deltas`` (hypothesis: random (old, new) pairs), ``step_pair`` (a seeded step of a given
density), a sparse-v3 round trip, and a bucket published with one codec and read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.codecs import get_codec

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


@st.composite
def deltas(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new) bf16 1-D tensors: random bits, specials, a drawn density, edge positions."""
    n = draw(st.integers(1, 3000))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    old_bits = torch.randint(0, 1 << 16, (n,), generator=g)
    special = torch.tensor(SPECIAL_BITS)
    pick = torch.rand(n, generator=g) < draw(st.sampled_from([0.0, 0.1, 0.5]))
    old_bits[pick] = special[torch.randint(0, len(SPECIAL_BITS), (int(pick.sum()),), generator=g)]
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.3, 1.0]))
    mask = torch.rand(n, generator=g) < density
    mask[0] |= draw(st.booleans())
    mask[-1] |= draw(st.booleans())
    kind = draw(st.sampled_from(["small", "mixed", "random"]))  # +-1..3 like real steps, ...
    step = torch.randint(1, 4, (n,), generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    if kind == "mixed":  # ... a few far moves among them (escapes), or arbitrary new bits
        far = torch.rand(n, generator=g) < 0.03
        step = torch.where(far, torch.randint(8, 1 << 15, (n,), generator=g), step)
    new_bits = torch.randint(0, 1 << 16, (n,), generator=g) if kind == "random" else old_bits + step
    new_bits = torch.where(mask, new_bits & 0xFFFF, old_bits)
    return bits_to_bf16(old_bits), bits_to_bf16(new_bits)


def v3_roundtrip(old: torch.Tensor, new: torch.Tensor, codec: Any = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Encode the changed elements of ``old -> new`` with ``codec`` (sparse-v3 by default),
    decode, check indices and applied bits."""
    codec = get_codec("sparse-v3") if codec is None else codec
    idx = torch.nonzero(old.view(torch.int16) != new.view(torch.int16)).flatten()
    roles, meta = codec.encode(idx, new[idx], old[idx])
    assert set(roles) == {"data"} and roles["data"].dtype == torch.uint8 and roles["data"].dim() == 1
    json.dumps(meta)  # the meta goes into the manifest
    indices, values, relative = codec.decode(roles, meta, idx.numel())
    assert relative and indices is not None and indices.dtype == torch.int64
    assert torch.equal(indices, idx)
    out = old.clone()
    TensorPatch("t", tuple(old.shape), indices, values, relative=True).apply_to(out)
    assert torch.equal(out.view(torch.int16), new.view(torch.int16))
    return roles, meta


def step_pair(n: int, density: float, kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new): ``density`` of ``n`` elements changed by a few ulps (``small``, like real
    AdamW steps), with 3% far moves (``mixed``), or to arbitrary bits (``random``)."""
    g = torch.Generator().manual_seed(seed)
    old_bits = torch.randint(0, 1 << 16, (n,), generator=g)
    mask = torch.rand(n, generator=g) < density
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    step = torch.randint(1, 4, (n,), generator=g) * sign
    if kind == "mixed":
        far = torch.rand(n, generator=g) < 0.03
        step = torch.where(far, torch.randint(8, 1 << 15, (n,), generator=g) * sign, step)
    new_bits = torch.randint(0, 1 << 16, (n,), generator=g) if kind == "random" else old_bits + step
    new_bits = torch.where(mask, new_bits & 0xFFFF, old_bits)
    new_bits = torch.where(mask & (new_bits == old_bits), (old_bits + 1) & 0xFFFF, new_bits)
    return bits_to_bf16(old_bits), bits_to_bf16(new_bits)


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

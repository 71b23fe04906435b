"""``sparse-v3``: bit-exact at every density, never larger than dense, strict on hostile chunks.

Every test runs twice: with the numba decoder (installed with vLLM) and with the numpy one
(used where numba is missing or cannot compile); the two must agree bit for bit, also on
corrupt chunks.
"""

from __future__ import annotations

import contextlib
import json
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.helpers.codec import (
    SPECIAL_BITS,
    bits_to_bf16,
    deltas,
    publish_and_read_back,
    step_pair,
    v3_roundtrip,
)
from vllm_deltasync.errors import FormatError
from vllm_deltasync.format import sparse_v3
from vllm_deltasync.format.codecs import CODECS, decode_chunk, get_codec
from vllm_deltasync.format.manifest import Chunk, Manifest, Region, TensorEntry
from vllm_deltasync.format.sparse_v3 import SparseV3Codec

V3 = get_codec("sparse-v3")


@pytest.fixture(autouse=True, params=["numba", "numpy"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which decoder the test runs: the numba kernel or the numpy passes."""
    if request.param == "numpy":
        monkeypatch.setattr(sparse_v3, "_KERNEL", [None])
    elif sparse_v3._kernel() is None:
        pytest.skip("numba is not installed (or failed to compile): only the numpy decoder runs")
    return str(request.param)


def _nbytes(roles: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in roles.values())


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(pair=deltas())
def test_roundtrip_is_bit_exact(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    v3_roundtrip(*pair)


DENSITIES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 0.5, 0.9, 0.99, 1.0)


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("kind", ["small", "mixed", "random"])
def test_every_density_round_trips_and_is_never_larger_than_dense(density: float, kind: str) -> None:
    """The size rule: a chunk's data is at most the dense bf16 size of its span (+1%)."""
    n = 60_000
    old, new = step_pair(n, density, kind, seed=int(density * 1000))
    roles, meta = v3_roundtrip(old, new)
    idx = torch.nonzero(old.view(torch.int16) != new.view(torch.int16)).flatten()
    span = int(idx[-1]) - int(idx[0]) + 1
    assert _nbytes(roles) <= 1.01 * 2 * span, (meta, _nbytes(roles), span)


@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_compact_on_small_steps(density: float) -> None:
    """i.i.d. positions, uniform +-1..3 ulp steps: within 4% of their entropy
    (``H(p) / p`` bits of position and ``log2(6)`` of value per changed element)."""
    import math

    old, new = step_pair(4_000_000, density, "small", seed=7)
    roles, _ = v3_roundtrip(old, new)
    changed = int((old.view(torch.int16) != new.view(torch.int16)).sum())
    h = -(density * math.log2(density) + (1 - density) * math.log2(1 - density))
    floor = (h / density + math.log2(6)) / 8
    assert _nbytes(roles) / changed <= 1.04 * floor + 100 / changed, (_nbytes(roles) / changed, floor)


def test_empty_chunk() -> None:
    for old in (None, torch.empty(0, dtype=torch.bfloat16)):
        roles, meta = V3.encode(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.bfloat16), old)
        assert _nbytes(roles) == 0
        indices, values, relative = V3.decode(roles, meta, 0)
        assert indices is not None and indices.numel() == 0 and values.numel() == 0
        assert relative == (old is not None)


@pytest.mark.parametrize("position", [0, 1, 255, 256, 70_000, 2**33 + 5])
@pytest.mark.parametrize("bits", [(0x3F80, 0x3F81), (0x0000, 0x8000), (0x7F80, 0xFFFF), (0x1234, 0x9234)])
def test_single_element(position: int, bits: tuple[int, int]) -> None:
    idx = torch.tensor([position])
    old, new = bits_to_bf16([bits[0]]), bits_to_bf16([bits[1]])
    roles, meta = V3.encode(idx, new, old)
    assert _nbytes(roles) <= 2  # a one-element span is 2 bytes dense
    indices, values, relative = V3.decode(roles, meta, 1)
    assert indices is not None and indices.tolist() == [position]
    assert relative and int(values[0]) == ((bits[1] - bits[0] + 2**15) % 2**16) - 2**15


def test_all_changed_and_specials() -> None:
    bits = SPECIAL_BITS * 300
    old = bits_to_bf16(bits)
    new = bits_to_bf16([(b + 1 + 977 * i) & 0xFFFF for i, b in enumerate(bits)])
    v3_roundtrip(old, new)


def test_gaps_beyond_16_and_32_bits() -> None:
    """Gaps of 2**16 .. 2**39 (high parts escaped into uint32 overflow), local indices up to 2**40 - 1."""
    positions = [0, 1, 2**16 + 3, 2**17, 2**17 + 300, 2**32 + 7, 2**39 + 1, 2**40 - 1]
    idx = torch.tensor(sorted(positions))
    g = torch.Generator().manual_seed(3)
    old = bits_to_bf16(torch.randint(0, 1 << 16, (idx.numel(),), generator=g))
    new = bits_to_bf16(old.view(torch.int16).to(torch.int64) + 5)
    roles, meta = V3.encode(idx, new, old)
    indices, values, _ = V3.decode(roles, meta, idx.numel())
    assert indices is not None and torch.equal(indices, idx)
    assert values.tolist() == [5] * idx.numel()
    with pytest.raises(FormatError, match="indices must lie"):
        V3.encode(torch.tensor([2**40]), new[:1], old[:1])


def test_many_escapes_of_both_kinds() -> None:
    """Long gaps among short ones and far moves among +-1 steps: both overflows in use."""
    g = torch.Generator().manual_seed(11)
    n = 20_000
    gaps = torch.where(torch.rand(n, generator=g) < 0.05, torch.randint(2000, 10**6, (n,), generator=g),
                       torch.randint(1, 200, (n,), generator=g))
    idx = torch.cumsum(gaps, 0) - gaps[0]
    old = bits_to_bf16(torch.randint(0, 1 << 16, (n,), generator=g))
    d = torch.where(torch.rand(n, generator=g) < 0.05, torch.randint(-32768, 32768, (n,), generator=g),
                    torch.randint(1, 3, (n,), generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1))
    d[d == 0] = -32768
    new = bits_to_bf16(old.view(torch.int16).to(torch.int64) + d)
    roles, meta = V3.encode(idx, new, old)
    assert meta["layout"] == "gaps" and meta["high_escapes"] > 0 and meta["value_escapes"] > 0
    indices, values, _ = V3.decode(roles, meta, n)
    assert indices is not None and torch.equal(indices, idx)
    assert torch.equal(values, (new.view(torch.int16) - old.view(torch.int16)))


def test_zero_differences_stay_listed() -> None:
    """An element listed with d = 0 (not a real change) still decodes to itself (escape)."""
    idx = torch.arange(0, 3000, 3)
    old = bits_to_bf16(torch.arange(idx.numel()))
    new = old.clone()
    new.view(torch.int16)[::2] += 1
    roles, meta = V3.encode(idx, new, old)
    assert meta["layout"] == "gaps"  # the span layout drops zeros: not eligible
    indices, values, _ = V3.decode(roles, meta, idx.numel())
    assert indices is not None and torch.equal(indices, idx)
    assert torch.equal(values, new.view(torch.int16) - old.view(torch.int16))


@pytest.mark.parametrize("n", [1, 100, 5000])
def test_raw_mode_keeps_absolute_values(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    idx = torch.sort(torch.randperm(10 * n, generator=g)[:n]).values
    bits = torch.randint(0, 1 << 16, (n,), generator=g)
    bits[: min(n, len(SPECIAL_BITS))] = torch.tensor(SPECIAL_BITS[: min(n, len(SPECIAL_BITS))])
    new = bits_to_bf16(bits)
    roles, meta = V3.encode(idx, new, None)
    assert meta["values"] == "raw" and meta["high_bits"] == 8
    indices, values, relative = V3.decode(roles, meta, n)
    assert not relative and indices is not None and torch.equal(indices, idx)
    assert values.dtype == torch.bfloat16 and torch.equal(values.view(torch.int16), new.view(torch.int16))


def test_encoder_refuses_bad_input() -> None:
    v = torch.zeros(2, dtype=torch.bfloat16)
    with pytest.raises(FormatError, match="needs indices"):
        V3.encode(None, v, v)
    with pytest.raises(FormatError, match="strictly increasing"):
        V3.encode(torch.tensor([3, 3]), v, v)
    with pytest.raises(FormatError, match="bf16"):
        V3.encode(torch.tensor([1, 3]), v.float(), v)


# --------------------------------------------------------------------------------------------
# hostile chunks: refused with a FormatError, before anything is sized by a claim


def _chunk(density: float = 0.02, n: int = 50_000) -> tuple[dict[str, torch.Tensor], dict[str, Any], int]:
    old, new = step_pair(n, density, "mixed", seed=5)
    idx = torch.nonzero(old.view(torch.int16) != new.view(torch.int16)).flatten()
    roles, meta = V3.encode(idx, new[idx], old[idx])
    return roles, meta, idx.numel()


@pytest.mark.parametrize("key,value", [
    ("layout", "bitmap"), ("layout", None), ("values", "diff8"), ("compression", "lz4"),
    ("first", -1), ("first", 2**40), ("first", True), ("first", 1.0), ("first", "0"),
    ("high_bits", 0), ("high_bits", 9), ("high_bits", True),
    ("high_escapes", -1), ("high_escapes", 10**12), ("value_escapes", 10**12),
    ("span", 10**12),
])
def test_hostile_meta_is_refused(key: str, value: Any) -> None:
    roles, meta, count = _chunk()
    bad = {**meta, key: value}
    if key == "span":
        bad["layout"] = "span"
    with pytest.raises(FormatError):
        V3.decode(roles, bad, count)


@pytest.mark.parametrize("missing", ["layout", "first", "values", "compression", "high_bits", "high_escapes"])
def test_incomplete_meta_is_refused(missing: str) -> None:
    roles, meta, count = _chunk()
    with pytest.raises(FormatError):
        V3.decode(roles, {k: v for k, v in meta.items() if k != missing}, count)


def test_escape_counts_and_sizes_must_agree() -> None:
    roles, meta, count = _chunk()
    assert meta["compression"] == "zstd" and meta["value_escapes"] > 0
    for key, delta in (("value_escapes", 1), ("value_escapes", -1), ("high_escapes", 1)):
        with pytest.raises(FormatError, match="refused before decompressing|escaped"):
            V3.decode(roles, {**meta, key: meta[key] + delta}, count)
    with pytest.raises(FormatError, match="refused before decompressing"):
        V3.decode(roles, meta, count + 1)  # a count the frame does not hold
    for hb in range(1, 9):  # another split of the field bytes: other values or a refusal, no crash
        try:
            indices, values, _ = V3.decode(roles, {**meta, "high_bits": hb, "value_escapes": 0
                                                   if hb == 8 else meta["value_escapes"]}, count)
        except FormatError:
            continue
        assert indices is not None and indices.numel() == values.numel() == count


def test_frames_and_roles_are_checked() -> None:
    roles, meta, count = _chunk()
    data = roles["data"]
    with pytest.raises(FormatError, match="role 'data'"):
        V3.decode({}, meta, count)
    with pytest.raises(FormatError, match="role 'data'"):
        V3.decode({"data": data.view(torch.int8)}, meta, count)
    with pytest.raises(FormatError, match="unexpected roles"):
        V3.decode({"data": data, "gaps": data}, meta, count)
    with pytest.raises(FormatError, match="corrupt"):
        V3.decode({"data": data[:-20].clone()}, meta, count)
    with pytest.raises(FormatError, match="corrupt"):
        V3.decode({"data": data[:3].clone()}, meta, count)
    flipped = data.clone()
    flipped[len(flipped) // 2] ^= 0x55
    with contextlib.suppress(FormatError):  # a corrupt frame, or other (checked) bytes
        V3.decode({"data": flipped}, meta, count)
    with pytest.raises(FormatError, match="has .* bytes, the meta implies"):
        V3.decode({"data": torch.zeros(7, dtype=torch.uint8)}, {**meta, "compression": "none"}, count)


def test_a_huge_claimed_frame_is_refused_before_decompressing() -> None:
    """The frame header's content size must equal what count and meta imply (<= 8 B/el)."""
    import zstandard

    roles, meta, count = _chunk()
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    with pytest.raises(FormatError, match="refused before decompressing"):
        V3.decode({"data": torch.frombuffer(bytearray(bomb), dtype=torch.uint8)}, meta, count)


def test_span_must_hold_count_changes() -> None:
    old, new = step_pair(4000, 1.0, "random", seed=1)
    idx = torch.nonzero(old.view(torch.int16) != new.view(torch.int16)).flatten()
    roles, meta = V3.encode(idx, new[idx], old[idx])
    assert meta["layout"] == "span"
    with pytest.raises(FormatError):
        V3.decode(roles, meta, idx.numel() - 1)


def test_decode_chunk_names_the_tensor() -> None:
    roles, meta, count = _chunk()
    entry = TensorEntry("model.w", (50_000,), "bfloat16", "sparse-v3", count,
                        (Chunk(0, {"data": "model.w.data"}, 0, count, {**meta, "high_bits": 0},
                               Region(0, 1, 50_000, 50_000)),))
    with pytest.raises(FormatError, match="'model.w' \\(sparse-v3\\)"):
        decode_chunk(entry, entry.chunks[0], {"model.w.data": roles["data"]}, source="x")


def test_decoded_indices_must_stay_in_the_region() -> None:
    roles, meta, count = _chunk()
    entry = TensorEntry("w", (50_000,), "bfloat16", "sparse-v3", count,
                        (Chunk(0, {"data": "k"}, 0, count, dict(meta), Region(0, 1, 1000, 1000)),))
    with pytest.raises(FormatError, match="outside"):
        decode_chunk(entry, entry.chunks[0], {"k": roles["data"]}, source="x")


# --------------------------------------------------------------------------------------------
# compatibility: the manifest names the release that reads it; older readers refuse clearly


def test_publisher_round_trip_and_requires(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    publish_and_read_back(tmp_path, "sparse-v3", format_version=2)  # for 0.3.x readers
    delta = (tmp_path / "bucket" / "manifests" / f"{4:012d}.json").read_bytes()
    anchor = (tmp_path / "bucket" / "manifests" / f"{3:012d}.json").read_bytes()
    assert json.loads(delta)["requires"] == "vllm-deltasync>=0.3.0"
    assert json.loads(anchor)["requires"] == "vllm-deltasync>=0.2.0"  # dense only: 0.2.0 reads it
    # a reader of the previous release (no sparse-v3 in its table) refuses, naming the upgrade
    monkeypatch.delitem(CODECS, "sparse-v3")  # type: ignore[attr-defined]
    with pytest.raises(FormatError, match=r"'sparse-v3' version 1 is unknown.*vllm-deltasync>=0\.3\.0"):
        Manifest.from_json(delta, source="m.json")
    Manifest.from_json(anchor, source="a.json")


def test_custom_level_reads_back() -> None:
    old, new = step_pair(20_000, 0.01, "small")
    v3_roundtrip(old, new, SparseV3Codec(level=3))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_random_corruption_is_a_format_error_or_a_well_formed_result(compression: str) -> None:
    """Flipped bytes and random meta values: a FormatError, or ``count`` well-typed elements."""
    rng = random.Random(compression)
    old, new = step_pair(3000 if compression == "none" else 200_000, 0.02, "mixed", seed=9)
    idx = torch.nonzero(old.view(torch.int16) != new.view(torch.int16)).flatten()
    roles, meta = V3.encode(idx, new[idx], old[idx])
    if compression == "none":  # tiny chunks are stored raw; force one
        roles, meta = V3.encode(idx[:40], new[idx[:40]], old[idx[:40]])
        idx = idx[:40]
    assert meta["compression"] == compression
    count = idx.numel()
    values = [0, 1, 2, 7, 8, 9, -1, 2**31, 2**40, None, "x", [1], 1.5, True]
    for _ in range(300):
        data = roles["data"].clone()
        m = dict(meta)
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.6 and data.numel():
                data[rng.randrange(data.numel())] = rng.randrange(256)
            else:
                m[rng.choice(sorted(m))] = rng.choice(values)
        try:
            indices, vals, _ = V3.decode({"data": data}, m, count)
        except FormatError:
            continue
        assert indices is not None and indices.dtype == torch.int64
        assert indices.numel() == vals.numel() == count


def test_publisher_default_codec_follows_the_format_version(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """v2 (default): sparse-v3. Format v1 is for readers older than 0.2.0: sparse-v2 by default,
    and sparse-v3 (read from 0.3.0 only) is refused."""
    from vllm_deltasync.errors import ConfigError
    from vllm_deltasync.trainer.publisher import DeltaPublisher

    with DeltaPublisher(f"file://{tmp_path}/a") as pub:
        assert pub.codec == "sparse-v3"
    with DeltaPublisher(f"file://{tmp_path}/b", format_version=1) as pub:
        assert pub.codec == "sparse-v2"
    with pytest.raises(ConfigError, match="format_version=1"):
        DeltaPublisher(f"file://{tmp_path}/c", format_version=1, codec="sparse-v3")


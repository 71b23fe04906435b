"""``sparse-v3``'s two encoders: the numba kernels (numba comes with vLLM) and the numpy passes
(where numba is missing or cannot compile) write the same bytes and the same meta, which the
decoder reads back; and frames of the zstd parameters 0.4.0 used (btopt) still decode."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.helpers.codec import SPECIAL_BITS, bits_to_bf16, deltas, step_pair
from vllm_deltasync.format import _sparse_v3_encoder as encoder
from vllm_deltasync.format import sparse_v3
from vllm_deltasync.format._sparse_v3_decoder import zstd_module
from vllm_deltasync.format.codecs import get_codec

V3 = get_codec("sparse-v3")


@pytest.fixture
def kernels() -> Any:
    found = sparse_v3._encode_kernels()
    if found is None:
        pytest.skip("numba is not installed (or failed to compile): only the numpy encoder runs")
    return found


def _both(idx: torch.Tensor, new: torch.Tensor, old: torch.Tensor | None, kernels: Any
          ) -> tuple[bytes, dict[str, Any]]:
    """Encode with both encoders, check they agree and that the chunk decodes; the bytes, meta."""
    out = []
    saved = list(sparse_v3._ENC_KERNEL)
    try:
        for use in (kernels, None):
            sparse_v3._ENC_KERNEL[:] = [use]
            roles, meta = V3.encode(idx, new, old)
            out.append((roles["data"].numpy().tobytes(), meta))
    finally:
        sparse_v3._ENC_KERNEL[:] = saved
    assert out[0][1] == out[1][1]
    assert out[0][0] == out[1][0]
    data, meta = out[0]
    indices, values, relative = V3.decode({"data": torch.frombuffer(bytearray(data), dtype=torch.uint8)}
                                          if data else {"data": torch.empty(0, dtype=torch.uint8)},
                                          meta, idx.numel())
    assert indices is not None and torch.equal(indices, idx)
    if old is None:
        assert not relative and torch.equal(values.view(torch.int16), new.view(torch.int16))
    else:
        assert relative and torch.equal(values, new.view(torch.int16) - old.view(torch.int16))
    return data, meta


def _changed(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(old.view(torch.int16) != new.view(torch.int16)).flatten()


@pytest.mark.parametrize("density", [0.001, 0.01, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("kind", ["small", "mixed", "random"])
def test_numba_and_numpy_encoders_write_the_same_bytes(density: float, kind: str, kernels: Any) -> None:
    old, new = step_pair(200_000, density, kind, seed=int(density * 1000))
    idx = _changed(old, new)
    _both(idx, new[idx], old[idx], kernels)
    _both(idx, new[idx], None, kernels)  # raw values (high_bits 8)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(pair=deltas())
def test_encoders_agree_on_random_deltas(pair: tuple[torch.Tensor, torch.Tensor], kernels: Any) -> None:
    old, new = pair
    idx = _changed(old, new)
    _both(idx, new[idx], old[idx], kernels)


def test_encoders_agree_on_edges(kernels: Any) -> None:
    empty = torch.empty(0, dtype=torch.bfloat16)
    _both(torch.empty(0, dtype=torch.int64), empty, empty, kernels)
    _both(torch.empty(0, dtype=torch.int64), empty, None, kernels)
    last = sparse_v3.MAX_INDEX
    for position in (0, 1, 255, 256, 70_000, last):  # one element: first index 0 or the last index
        for a, b in [(0x3F80, 0x3F81), (0x0000, 0x8000), (0x7F80, 0xFFFF)]:
            _both(torch.tensor([position]), bits_to_bf16([b]), bits_to_bf16([a]), kernels)
    # large gaps (high parts beyond 8, 16 and 32 bits), first index 0 and the last local index
    idx = torch.tensor([0, 1, 2**8, 2**16 + 3, 2**17, 2**17 + 300, 2**32 + 7, 2**39 + 1, last])
    old = bits_to_bf16(torch.arange(idx.numel()) * 977)
    for d in (1, -1, 5, 300, -32768, 32767):
        _both(idx, bits_to_bf16(old.view(torch.int16).to(torch.int64) + d), old, kernels)
    # escapes of both kinds, zero differences (listed, d = 0) and special values
    g = torch.Generator().manual_seed(5)
    n = 30_000
    gaps = torch.where(torch.rand(n, generator=g) < 0.05, torch.randint(2000, 10**7, (n,), generator=g),
                       torch.randint(1, 300, (n,), generator=g))
    idx = torch.cumsum(gaps, 0) - gaps[0]
    bits = torch.randint(0, 1 << 16, (n,), generator=g)
    bits[: len(SPECIAL_BITS)] = torch.tensor(SPECIAL_BITS)
    old = bits_to_bf16(bits)
    d = torch.where(torch.rand(n, generator=g) < 0.05, torch.randint(-32768, 32768, (n,), generator=g),
                    torch.randint(-3, 4, (n,), generator=g))
    new = bits_to_bf16(old.view(torch.int16).to(torch.int64) + d)
    _, meta = _both(idx, new, old, kernels)
    assert meta["high_escapes"] > 0 and meta["value_escapes"] > 0
    _both(idx, new, None, kernels)
    for hb_gap, hb_val in [(1, 1), (40, 1), (3000, 1), (1, 3000)]:  # pushes high_bits across 1..8
        idx = torch.arange(0, hb_gap * 5000, hb_gap)
        old = bits_to_bf16(torch.zeros(idx.numel(), dtype=torch.int64))
        new = bits_to_bf16(torch.arange(idx.numel()) % hb_val + 1)
        _both(idx, new, old, kernels)


def test_every_high_bits_choice_matches(kernels: Any) -> None:
    """The kernels with each ``high_bits`` forced give the numpy passes' sections."""
    g = torch.Generator().manual_seed(9)
    n = 5000
    gaps = torch.randint(1, 3000, (n,), generator=g)
    gaps[::97] = 2**33
    idx = (torch.cumsum(gaps, 0) - gaps[0]).numpy()
    diff = torch.randint(-40, 41, (n,), generator=g).to(torch.int16).numpy()
    diff[::53] = -32768
    scan, build, tables = kernels
    joint = np.zeros(65536, np.int64)
    used = scan(idx, diff, joint)
    high = np.diff(idx, prepend=idx[0]) >> 8
    assert np.array_equal(joint.reshape(256, 256), encoder._joint_histogram(high, encoder._zigzag_code(diff)))
    assert tuple(used) == (min(int(high.max()), 255), min(int(encoder._zigzag_code(diff).max()), 255))
    for bounds in (None, (used[0] + 1, used[1] + 1), (256, 256)):  # any bounds: the same choice
        assert encoder._choose_high_bits(joint.reshape(256, 256), n, bounds, tables) == \
            encoder._choose_high_bits(encoder._joint_histogram(high, encoder._zigzag_code(diff)), n)
    for hb in range(1, 9):
        low, fields = np.empty(n, np.uint8), np.empty(n, np.uint8)
        high_over, value_over = np.empty(n, "<u4"), np.empty(n, "<i2")
        he, ve = build(idx, diff, hb, low, fields, high_over, value_over)
        hm = (1 << hb) - 1
        want_fields = np.minimum(high, hm).astype(np.uint8)
        codes = encoder._zigzag_code(diff)
        if hb < 8:
            vm = (1 << (8 - hb)) - 1
            want_fields |= np.minimum(codes, vm).astype(np.uint8) << np.uint8(hb)
            assert value_over[:ve].tolist() == diff[codes >= vm].tolist()
        else:
            assert ve == 0
        assert low.tolist() == (np.diff(idx, prepend=idx[0]) & 0xFF).tolist()
        assert fields.tolist() == want_fields.tolist()
        assert high_over[:he].tolist() == (high[high >= hm] - hm).tolist()


def test_frames_of_the_old_zstd_parameters_still_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.4.0 compressed with btopt at level 15: its frames decode to the same elements."""
    zstd = zstd_module()
    old, new = step_pair(300_000, 0.01, "mixed")
    idx = _changed(old, new)
    roles, meta = V3.encode(idx, new[idx], old[idx])
    assert meta["compression"] == "zstd"
    body = V3.decode(roles, meta, idx.numel())
    sections: list[bytes] = []
    monkeypatch.setattr(encoder, "_compress", lambda s, level: sections.extend(s) or b"\0" * 10**9)
    V3.encode(idx, new[idx], old[idx])  # captures the sections (the huge fake frame loses)
    params = zstd.ZstdCompressionParameters.from_level(
        15, window_log=17, chain_log=12, hash_log=12, search_log=1, min_match=7,
        strategy=zstd.STRATEGY_BTOPT, write_content_size=1, write_checksum=0)
    obj = zstd.ZstdCompressor(compression_params=params).compressobj(size=sum(map(len, sections)))
    frame = b"".join([*(obj.compress(s) + obj.flush(zstd.COMPRESSOBJ_FLUSH_BLOCK) for s in sections if s),
                      obj.flush(zstd.COMPRESSOBJ_FLUSH_FINISH)])
    assert frame != roles["data"].numpy().tobytes()
    again = V3.decode({"data": torch.frombuffer(bytearray(frame), dtype=torch.uint8)}, meta, idx.numel())
    assert all(torch.equal(a, b) for a, b in zip(again[:2], body[:2], strict=True))  # type: ignore[arg-type]


def test_a_numba_that_fails_to_compile_leaves_the_numpy_encoder(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    numba = pytest.importorskip("numba", reason="numba is not installed: nothing to break")
    old, new = step_pair(50_000, 0.01, "mixed")
    idx = _changed(old, new)
    want = V3.encode(idx, new[idx], old[idx])

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no LLVM target here")

    monkeypatch.setattr(numba, "njit", broken)
    monkeypatch.setattr(sparse_v3, "_ENC_KERNEL", [])
    with caplog.at_level(logging.WARNING, logger=sparse_v3.__name__):
        got = V3.encode(idx, new[idx], old[idx])
        V3.encode(idx, new[idx], old[idx])  # decided once per process
    assert sparse_v3._ENC_KERNEL == [None]
    assert [r.getMessage() for r in caplog.records] == [
        "sparse-v3: numba could not compile the encoder (OSError: no LLVM target here); "
        "encoding with numpy (same bytes, slower)"]
    assert got[1] == want[1] and torch.equal(got[0]["data"], want[0]["data"])

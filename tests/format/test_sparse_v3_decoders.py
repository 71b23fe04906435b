"""``sparse-v3``'s two decoders: the numba kernel (numba comes with vLLM) and the numpy passes
(where numba is missing or cannot compile) give the same indices, values and errors."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.helpers.codec import bits_to_bf16, step_pair, v3_roundtrip
from vllm_deltasync.errors import FormatError
from vllm_deltasync.format import sparse_v3
from vllm_deltasync.format.codecs import get_codec

V3 = get_codec("sparse-v3")


def _both(roles: dict[str, torch.Tensor], meta: dict[str, Any], count: int, kernel: Any) -> tuple[Any, Any]:
    """(numba result, numpy result) of one decode; a result is the output or the error text."""
    out: list[Any] = []
    for use in (kernel, None):
        sparse_v3._KERNEL[:] = [use]
        try:
            indices, values, relative = V3.decode(roles, meta, count)
            assert indices is not None
            out.append((indices.tolist(), values.view(torch.int16).tolist(), relative))
        except FormatError as exc:
            out.append(str(exc))
    return out[0], out[1]


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_numba_and_numpy_decoders_agree_on_corrupt_chunks(
    compression: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same output, or the same error, from both decoders on hundreds of damaged chunks
    (flipped bytes, escape counts and field widths that disagree with the body)."""
    kernel = sparse_v3._kernel()
    if kernel is None:
        pytest.skip("numba is not installed (or failed to compile): there is one decoder only")
    monkeypatch.setattr(sparse_v3, "_KERNEL", [kernel])
    rng = random.Random(f"agree-{compression}")
    old, new = step_pair(3000 if compression == "none" else 60_000, 0.05, "mixed", seed=4)
    idx = torch.nonzero(old.view(torch.int16) != new.view(torch.int16)).flatten()
    if compression == "none":
        idx = idx[:12]
    old_v, new_v = old[idx], new[idx]
    far = torch.tensor([old.numel() + 70_000, old.numel() + 2**33])  # high escapes
    idx = torch.cat([idx, far])
    old_v = torch.cat([old_v, bits_to_bf16(torch.tensor([0x3F80, 0x0001]))])
    new_v = torch.cat([new_v, bits_to_bf16(torch.tensor([0x4F80, 0x8001]))])  # value escapes
    roles, meta = V3.encode(idx, new_v, old_v)
    assert meta["compression"] == compression and meta["high_escapes"] > 0 and meta["value_escapes"] > 0
    count = idx.numel()
    good = _both(roles, meta, count, kernel)
    assert good[0] == good[1] and good[0][0] == idx.tolist()
    differed = 0
    for _ in range(400):
        data = roles["data"].clone()
        m = dict(meta)
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.5:
                data[rng.randrange(data.numel())] = rng.randrange(256)
            else:
                key = rng.choice(["high_escapes", "value_escapes", "high_bits", "first"])
                m[key] = max(0, m[key] + rng.choice([-2, -1, 1, 2]))
        fast, slow = _both({"data": data}, m, count, kernel)
        assert fast == slow
        differed += fast != good[0]
    assert differed > 300  # the damage reached the decoders


def test_a_numba_that_fails_to_compile_leaves_the_numpy_decoder(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """numba present but broken (here: its compiler raises): one warning, then numpy decodes."""
    numba = pytest.importorskip("numba", reason="numba is not installed: nothing to break")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no LLVM target here")

    monkeypatch.setattr(numba, "njit", broken)
    monkeypatch.setattr(sparse_v3, "_KERNEL", [])
    with caplog.at_level(logging.WARNING, logger=sparse_v3.__name__):
        V3.prepare()
        V3.prepare()  # decided once per process
    assert sparse_v3._KERNEL == [None]
    assert [r.getMessage() for r in caplog.records] == [
        "sparse-v3: numba could not compile the decoder (OSError: no LLVM target here); "
        "decoding with numpy (~1.5x slower)"]
    old, new = step_pair(50_000, 0.01, "mixed")
    v3_roundtrip(old, new)


def test_prepare_without_jit_never_loads_numba() -> None:
    """``SyncConfig.decoder="numpy"`` (``prepare_decoders(jit=False)``): chunks decode and numba
    is never imported (a fresh interpreter, as a worker process)."""
    code = (
        "import sys, torch\n"
        "from vllm_deltasync.format.codecs import get_codec, prepare_decoders\n"
        "prepare_decoders(jit=False)\n"
        "v3 = get_codec('sparse-v3')\n"
        "idx = torch.arange(0, 300_000, 7)\n"
        "old = torch.zeros(idx.numel(), dtype=torch.bfloat16)\n"
        "new = old + 1\n"
        "roles, meta = v3.encode(idx, new, old)\n"
        "i, d, rel = v3.decode(roles, meta, idx.numel())\n"
        "assert meta['compression'] == 'zstd' and torch.equal(i, idx) and rel\n"
        "print('numba' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"

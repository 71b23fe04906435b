"""The publisher's diff (trainer/diff.py): the host path (in place, numba or numpy) and the
device path (torch kernels beside the parameter) against a plain reference, on this machine's
CPU device; the same device path runs on CUDA in the GPU script (marked ``gpu``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.helpers.publishing import Trainer, bits_equal, read_full
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.trainer import diff as diff_mod
from vllm_deltasync.trainer.diff import Differ

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").to(torch.bfloat16).contiguous().view(torch.int16).numpy().reshape(-1).copy()


@pytest.fixture(params=["numba", "numpy"])
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """The host path with its numba kernel and with the numpy passes that replace it."""
    saved = list(diff_mod._KERNEL)
    if request.param == "numpy":
        diff_mod._KERNEL[:] = [None]
    elif diff_mod._kernel() is None:
        pytest.skip("numba is not installed here: the numpy case covers the host path")
    yield request.param
    diff_mod._KERNEL[:] = saved


def _walk(differ: Differ, device: str, dtype: torch.dtype, *, cuts: tuple[int, ...] = ()) -> None:
    """Eight steps of a parameter whose ~1% of elements move (odd size: the int64 words'
    tail), an anchor at step 4, a non-contiguous parameter: every diff equals the reference."""
    gen = torch.Generator().manual_seed(3)
    n = 1_000_003
    w = torch.randn(n, generator=gen).to(dtype).to(device)
    wt = torch.randn(301, 257, generator=gen).to(dtype).to(device).t()  # not contiguous
    prev = {"w": _bits(w), "wt": _bits(wt)}
    for step in range(8):
        full = step in (0, 4)
        for name, p in (("w", w), ("wt", wt)):
            d = differ.diff(name, p, full=full, cuts=cuts if name == "w" else ())
            now, before = _bits(p), prev[name]
            where = np.flatnonzero(now != before)
            if full:
                assert d.indices is None and d.old is None
                assert np.array_equal(_bits(d.new), now)
                assert d.changed == (now.size if step == 0 else where.size)
            else:
                assert d.indices is not None and d.old is not None
                assert np.array_equal(d.indices.numpy(), where)
                assert np.array_equal(_bits(d.new), now[where])
                assert np.array_equal(_bits(d.old), before[where])
                assert d.changed == where.size
            if name == "w" and cuts and step:
                edges = (0, *cuts, n)
                assert d.counts == tuple(int(np.count_nonzero(now[a:b] != before[a:b]))
                                         for a, b in zip(edges, edges[1:], strict=False))
            prev[name] = now
        pick = torch.randint(0, n, (n // 100,), generator=gen).to(device)
        w[pick] += torch.randn(pick.numel(), generator=gen).to(dtype).to(device) * 1e-2
        wt[0, :50] += 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_diff_equals_the_reference(kernel: str, dtype: torch.dtype) -> None:
    _walk(Differ(chunk_elements=1 << 17), "cpu", dtype, cuts=(5, 400_000, 400_001))


def test_host_diff_of_a_view_at_an_odd_offset(kernel: str) -> None:
    """A bf16 parameter that is a view one element into its storage (as flattened FSDP
    shards are), diffed in place with cuts at odd offsets: in some chunks the parameter's
    memory is 8-byte aligned where the baseline's is not (and the other way round), so the
    fused pass must compare element by element there; every diff equals the reference."""
    gen = torch.Generator().manual_seed(5)
    storage = torch.randn(300_001, generator=gen).to(torch.bfloat16)
    w = storage[1:]
    assert w.data_ptr() % 8 == 2
    differ = Differ(chunk_elements=1 << 14, threads=1)
    cuts = (3, 4, 7, 100_001, 200_002)
    before = _bits(w)
    differ.diff("w", w, full=True, cuts=cuts)
    for _ in range(4):
        pick = torch.randint(0, w.numel(), (3_000,), generator=gen)
        w[pick] += 1.0
        w[:8] += 1.0  # the first chunks, of 3 and 1 and 3 elements
        now = _bits(w)
        where = np.flatnonzero(now != before)
        d = differ.diff("w", w, full=False, cuts=cuts)
        assert d.indices is not None and d.old is not None
        assert np.array_equal(d.indices.numpy(), where)
        assert np.array_equal(_bits(d.new), now[where])
        assert np.array_equal(_bits(d.old), before[where])
        assert np.array_equal(differ._base["w"].bits.numpy(), now)
        before = now
    # The word views cover the same elements of both arrays or none of either.
    a = np.zeros(16, np.int16)
    for x, y in ((a[1:13], a[4:16]), (a[4:16], a[1:13]), (a[0:12], a[4:16])):
        wx, wy = diff_mod._words(x, y)
        assert wx.size == wy.size and (wx.size == 0) == bool(x.ctypes.data % 8 or y.ctypes.data % 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_diff_equals_the_reference(device: str, dtype: torch.dtype) -> None:
    """The accelerator code path, the device a parameter: CPU here, CUDA where there is one."""
    _walk(Differ(device_path=True), device, dtype, cuts=(5, 400_000, 400_001))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_cuda_parameters_through_the_pinned_host_buffer() -> None:
    _walk(Differ(previous_on="host", chunk_elements=1 << 16), "cuda", torch.bfloat16)


def test_the_anchor_lends_its_baseline_and_copies_only_while_lent(kernel: str) -> None:
    """An anchor's data is the baseline itself (no second copy); a diff before the upload
    released it copies it first, so the anchor's bytes never change under the upload."""
    differ = Differ()
    w = torch.randn(10_000).to(torch.bfloat16)
    job1, job2 = object(), object()
    anchor = differ.diff("w", w, full=True, job=job1)
    kept = anchor.new.clone()
    w[::7] += 1.0
    d = differ.diff("w", w, full=False)  # job1 still uploading: copy on write
    assert d.changed > 0 and torch.equal(anchor.new.view(torch.int16), kept.view(torch.int16))
    anchor2 = differ.diff("w", w, full=True, job=job2)
    differ.release(job2)
    w[::5] += 1.0
    base = differ._base["w"].bits
    differ.diff("w", w, full=False)
    assert differ._base["w"].bits is base  # released: updated in place, no copy
    assert torch.equal(anchor2.new.view(torch.int16), base)  # the same memory, now moved on


def test_publisher_holds_no_second_copy_of_cpu_bf16_weights(bucket: str) -> None:
    """CPU bf16 parameters: the publisher keeps one copy (the baseline), bit-exact steps."""
    trainer = Trainer()
    weights = {k: v.to(torch.bfloat16) for k, v in trainer.weights.items()}
    with DeltaPublisher(bucket, anchor_every=3) as pub:
        for step in range(5):
            for v in weights.values():
                v.view(-1)[step::97] += 1e-2
            pub.publish(step, weights)
            pub.flush()
            assert bits_equal(read_full(bucket, step), weights)
            gc.collect()
            bases = pub._differ._base
            assert set(bases) == set(weights)
            assert all(b.bits.data_ptr() != w.data_ptr() for b, w in zip(
                bases.values(), weights.values(), strict=True))
            assert all(b.lent is None for b in bases.values())  # every job released its lease


@pytest.mark.parametrize("device", DEVICES)
def test_publisher_on_the_device_path(bucket: str, device: str) -> None:
    """The whole publisher with the device path of the diff (forced on CPU here): every step
    read back from the bucket equals the trainer's bf16 weights."""
    trainer = Trainer()
    with DeltaPublisher(bucket, anchor_every=3) as pub:
        pub._differ = Differ(device_path=True)
        for step in range(6):
            trainer.step()
            pub.publish(step, {k: v.to(device) for k, v in trainer.weights.items()})
            pub.flush()
            assert bits_equal(read_full(bucket, step), trainer.bf16())
    assert all(b.device for b in pub._differ._base.values())


def test_previous_on_is_checked(bucket: str) -> None:
    from vllm_deltasync.errors import ConfigError

    with pytest.raises(ConfigError, match="previous_on='gpu' must be 'device'"):
        DeltaPublisher(bucket, previous_on="gpu")
    with pytest.raises(ConfigError, match="encode_threads=-1 must be an integer >= 0"):
        DeltaPublisher(bucket, encode_threads=-1)


def test_shares_balance_the_elements_and_cover_every_tensor() -> None:
    sizes = {"big": 4_000_000, "mid": 700_000, **{f"s{i}": 512 for i in range(17)},
             **{f"m{i}": 260_000 for i in range(20)}}
    shares = diff_mod._shares(list(sizes), sizes, 3)
    assert sorted(n for share in shares for n in share) == sorted(sizes)
    loads = [sum(sizes[n] for n in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert diff_mod._shares(["a"], {"a": 0}, 2) == [["a"], []]


@pytest.mark.parametrize("threads", [2, 3])
def test_diff_all_on_threads_equals_one_thread(kernel: str, threads: int) -> None:
    """Many tensors (the calling thread and the pool each diff a share): every diff and every
    baseline equal those of one thread."""
    gen = torch.Generator().manual_seed(9)
    sizes = [5_000, 513, 70_001, 3, 200_000, 1_000, 9]
    ws = {f"t{i}": torch.randn(n, generator=gen).to(torch.bfloat16) for i, n in enumerate(sizes)}
    one, many = Differ(threads=1), Differ(threads=threads)
    for step in range(4):
        a = one.diff_all(ws, full=step == 0)
        b = many.diff_all(ws, full=step == 0)
        assert list(a) == list(b) == list(ws)
        for name in ws:
            assert a[name].changed == b[name].changed
            for x, y in ((a[name].indices, b[name].indices), (a[name].new, b[name].new),
                         (a[name].old, b[name].old)):
                assert (x is None and y is None) or (
                    x is not None and y is not None and np.array_equal(_bits(x) if x.dtype == torch.bfloat16 else x.numpy(),
                                                                       _bits(y) if y.dtype == torch.bfloat16 else y.numpy()))
            assert torch.equal(one._base[name].bits, many._base[name].bits)
        for w in ws.values():
            w.view(torch.int16)[:: 37] += 1
    many.close()

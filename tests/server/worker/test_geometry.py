"""Property test of the probe + translation on arbitrary view chains (no vLLM).

A toy model's loader copies a random chain of views of the checkpoint tensor (narrow, transpose,
select, unsqueeze, reshape of contiguous pieces) into a random strided window of a parameter.
Ground truth is the same loader run on real data; the shard map, built from a meta probe, must
reproduce it for a random sparse patch, a dense patch and a partial dense run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.server.vllm.loaders import LOADER
from vllm_deltasync.server.worker.apply import apply_patches, prepare
from vllm_deltasync.server.worker.shardmap import ShardMap

View = Callable[[torch.Tensor], torch.Tensor]


def _draw_chain(data: st.DataObject, shape: tuple[int, ...]) -> tuple[list[View], tuple[int, ...]]:
    chain: list[View] = []
    t = torch.empty(shape, device="meta")
    for _ in range(data.draw(st.integers(0, 4))):
        op = data.draw(st.sampled_from(["narrow", "transpose", "select", "unsqueeze", "flatten"]))
        dim = data.draw(st.integers(0, t.dim() - 1))
        if op == "narrow":
            start = data.draw(st.integers(0, t.shape[dim] - 1))
            length = data.draw(st.integers(1, t.shape[dim] - start))
            f: View = lambda x, d=dim, s=start, n=length: x.narrow(d, s, n)  # noqa: E731
        elif op == "transpose":
            other = data.draw(st.integers(0, t.dim() - 1))
            f = lambda x, a=dim, b=other: x.transpose(a, b)  # noqa: E731
        elif op == "select" and t.dim() > 1:
            index = data.draw(st.integers(0, t.shape[dim] - 1))
            f = lambda x, d=dim, i=index: x.select(d, i)  # noqa: E731
        elif op == "unsqueeze":
            f = lambda x, d=dim: x.unsqueeze(d)  # noqa: E731
        elif op == "flatten" and t.is_contiguous():
            f = lambda x: x.reshape(-1)  # noqa: E731
        else:
            continue
        chain.append(f)
        t = f(t)
    return chain, tuple(t.shape)


class _Toy(torch.nn.Module):
    def __init__(self, chain: list[View], dst: Callable[[torch.Tensor], torch.Tensor], size: int):
        super().__init__()
        self.p = torch.nn.Parameter(torch.full((size,), -1.0, dtype=torch.float64), requires_grad=False)
        self.chain, self.dst = chain, dst

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, w in weights:
            for f in self.chain:
                w = f(w)
            self.dst(self.p.data).copy_(w)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_translation_reproduces_any_view_chain(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    chain, out_shape = _draw_chain(data, shape)
    n = torch.Size(out_shape).numel()
    pad = data.draw(st.integers(0, 5))
    flip = data.draw(st.booleans()) and len(out_shape) > 1

    def dst(p: torch.Tensor) -> torch.Tensor:
        window = p[pad : pad + n]
        if flip:  # write through a transposed destination layout
            return window.view(tuple(reversed(out_shape))).permute(*reversed(range(len(out_shape))))
        return window.view(out_shape)

    numel = torch.Size(shape).numel()
    old, new = torch.randn(numel, dtype=torch.float64), torch.randn(numel, dtype=torch.float64)
    size = n + pad + 3
    live = _Toy(chain, dst, size)
    live.load_weights([("w", old.view(shape))])
    before = live.p.detach().clone()
    shardmap = ShardMap.from_model(live, {"w": (shape, "float64")}, loader=LOADER)
    assert torch.equal(live.p, before)  # the probe wrote nothing
    idx = (torch.rand(numel) < 0.5).nonzero().squeeze(1)
    cut = data.draw(st.integers(0, numel))
    selections = [
        (TensorPatch("w", shape, idx, new[idx]), idx),  # sparse half
        (TensorPatch("w", shape, None, new[:cut].clone()), torch.arange(cut)),  # a run ...
        (TensorPatch("w", shape, None, new[cut:].clone(), offset=cut), torch.arange(cut, numel)),
    ]
    state = old.clone()
    for patch, changed in selections:  # each patch checked on its own against the loader
        state[changed] = new[changed]
        apply_patches(prepare(shardmap.translate(patch)))
        truth = _Toy(chain, dst, size)
        truth.load_weights([("w", old.view(shape))])
        truth.load_weights([("w", state.view(shape))])
        assert torch.equal(live.p, truth.p)

"""ShardMap + apply against vLLM's own loaders, for every rank of TP = 1, 2, 4, 8.

For each model and rank: load a random full checkpoint with the real ``load_weights``, derive the
shard map, apply sparse / relative / dense / partial-dense patches in place, and compare bit for
bit with a fresh model of the same rank loaded from the patched full checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tp_world import (
    TPWorld,
    assert_same_params,
    make_step,
    random_checkpoint,
    sha256_bytes,
    state_bits,
)
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.server.vllm.loaders import LOADER
from vllm_deltasync.server.worker.apply import (
    apply_patches,
    checkpoint_digest,
    prepare,
    tensor_digest,
)
from vllm_deltasync.server.worker.shardmap import ShardMap, translate_all


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_bias", "llama_tied"])
def test_apply_matches_vllm_loader_on_every_rank(tp_world: TPWorld, kind: str, tp: int) -> None:
    params = tp_world.model(kind).checkpoint_params()
    base = random_checkpoint(params, seed=tp)
    steps, full = [], base
    for step in range(3):
        patches, full = make_step(full, step)
        steps.append((patches, full))
    for rank in range(tp):
        where = f"{kind} TP={tp} rank={rank}"
        live = tp_world.build(kind, tp, rank)
        live.load_weights(iter(base.items()))
        before = state_bits(live)
        shardmap = ShardMap.from_model(live, params, loader=LOADER)
        for name, bits in state_bits(live).items():
            assert torch.equal(bits, before[name]), f"{where}: from_model changed {name}"
        addresses = {n: p.data_ptr() for n, p in live.named_parameters()}
        for step, (patches, after) in enumerate(steps):
            written = apply_patches(prepare(translate_all(shardmap, patches)))
            assert written > 0
            ref = tp_world.build(kind, tp, rank)
            ref.load_weights(iter(after.items()))
            assert_same_params(live, ref, f"{where} step={step}")
            for name in params:
                got = tensor_digest(shardmap, name)
                assert got == checkpoint_digest(shardmap, name, after[name]), f"{where}: {name}"
                if tp == 1:
                    assert got == sha256_bytes(after[name])
        assert {n: p.data_ptr() for n, p in live.named_parameters()} == addresses


@pytest.mark.parametrize("tp", [2, 8])
def test_blocks_stay_compact(tp_world: TPWorld, tp: int) -> None:
    """A placement is one affine block per name and rank, whatever the tensor size."""
    params = tp_world.model("qwen2_bias").checkpoint_params()
    shardmap = ShardMap.from_model(tp_world.build("qwen2_bias", tp, 1), params, loader=LOADER)
    for name in params:
        targets = shardmap.targets(name)
        assert len(targets) == 1, name
        block = targets[0].block
        if name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight", "norm.weight")):
            assert len(block.sizes) == 1, (name, block)  # one contiguous range
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert len(block.sizes) == 2 and block.src_strides[1] == 1, (name, block)


def test_kv_heads_replicated_across_ranks(tp_world: TPWorld) -> None:
    """TP=8 over 2 KV heads: ranks 0-3 hold head 0, ranks 4-7 head 1, each fully."""
    params = tp_world.model("qwen2_bias").checkpoint_params()
    name = "model.layers.1.self_attn.k_proj.weight"
    sources = []
    for rank in range(8):
        shardmap = ShardMap.from_model(tp_world.build("qwen2_bias", 8, rank), params, loader=LOADER)
        (target,) = shardmap.targets(name)
        sources.append((target.block.src_offset, target.block.numel))
    head = params[name][0][0] // 2 * params[name][0][1]
    assert sources == [(0, head)] * 4 + [(head, head)] * 4


def test_probe_skips_padding_fill(tp_world: TPWorld) -> None:
    """vLLM's embedding loader zero-fills vocab padding; the probe must not."""
    params = tp_world.model("qwen2_bias").checkpoint_params()
    model = tp_world.build("qwen2_bias", 8, 6)  # rows 96..99 of 100: 12 padding rows
    embed = dict(model.named_parameters())["model.embed_tokens.weight"]
    embed.data.fill_(7.0)
    ShardMap.from_model(model, params, loader=LOADER)
    assert bool((embed == 7.0).all())


def test_empty_vocab_shard_is_placed_with_no_blocks(tp_world: TPWorld) -> None:
    params = tp_world.model("qwen2_bias").checkpoint_params()
    shardmap = ShardMap.from_model(tp_world.build("qwen2_bias", 8, 7), params, loader=LOADER)  # rows 112.. > 100
    assert shardmap.targets("model.embed_tokens.weight") == []
    patch = TensorPatch("model.embed_tokens.weight", (100, 64), torch.tensor([0, 6399]),
                        torch.ones(2, dtype=torch.bfloat16))
    assert shardmap.translate(patch) == []

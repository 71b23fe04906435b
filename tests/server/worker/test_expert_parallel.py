"""Expert parallelism: index translation at EP = 2, 4, 8 against vLLM's own expert maps.

With ``enable_expert_parallel`` vLLM splits the experts of each MoE layer over the TP group
(EP size = TP size, the attention layers stay tensor-parallel): rank ``r`` holds whole experts
at the local indices of its ``expert_map`` (global -> local, -1: elsewhere), and the experts'
loaders decline (return False for) experts that are not local. The model classes are built
here as EP rank ``r`` of ``n`` with the ``tp_world`` scaffolding (no engine, no after-load
processing: the loader layout is what is checked; the CPU kernel's repack on top of it is
``layouts.py``'s job, tested in the engine tests).

For Qwen3-MoE and Mixtral checkpoints (per-expert tensors, as ``save_pretrained`` writes
them), 12 experts (EP 8: ranks 0-3 hold two experts, ranks 4-7 one), linear placement (vLLM
0.32 falls back to it from ``round_robin`` unless the model has expert groups):

* every element of every checkpoint expert tensor lands exactly once across the ranks, on the
  rank and at the local expert index vLLM's ``expert_map`` of that layer names;
* a declined expert is recorded as ignored on the ranks that do not hold it, never an error;
* patches applied through each rank's map give exactly the parameters vLLM's own
  ``load_weights`` gives from the patched full checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.tp_world import (
    TinyModel,
    TPWorld,
    assert_same_params,
    make_step,
    random_checkpoint,
    single_process_world,
)
from vllm_deltasync.server.vllm.loaders import LOADER
from vllm_deltasync.server.worker.apply import apply_patches, prepare
from vllm_deltasync.server.worker.checkpoint import checkpoint_params
from vllm_deltasync.server.worker.shardmap import ShardMap, translate_all

EXPERTS = 12
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name -> (transformers config, vLLM class "module:Class", config kwargs)
    "qwen3_moe": ("Qwen3MoeConfig", "vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM",
                  dict(num_experts=EXPERTS, moe_intermediate_size=32, decoder_sparse_step=1,
                       head_dim=8)),
    "mixtral": ("MixtralConfig", "vllm.model_executor.models.mixtral:MixtralForCausalLM",
                dict(num_local_experts=EXPERTS, intermediate_size=32)),
}
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, num_experts_per_tok=2, max_position_embeddings=128,
              torch_dtype="bfloat16")
EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\..*experts\.(\d+)\.(\w+)\.weight$")


def _ep_model(world: TPWorld, family: str) -> tuple[str, dict[str, Any]]:
    """Register a MoE model in ``world`` with expert parallelism on; its checkpoint params."""
    kind = f"ep-{family}"
    if kind not in world.models:
        import importlib

        import transformers
        from vllm.config import ModelConfig, ParallelConfig, VllmConfig

        cfg_name, where, kw = FAMILIES[family]
        cfg = getattr(transformers, cfg_name)(**{**COMMON, **kw})
        path: Path = world.tmp / kind
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)  # per-expert names, as published
        mc = ModelConfig(model=str(path), dtype="bfloat16", skip_tokenizer_init=True,
                         enforce_eager=True)
        pc = ParallelConfig(enable_expert_parallel=True)
        module, cls = where.split(":")
        vllm_cls = getattr(importlib.import_module(module), cls)
        world.models[kind] = TinyModel(kind, cfg, VllmConfig(model_config=mc, parallel_config=pc),
                                       vllm_cls)
    return kind, checkpoint_params(str(world.tmp / kind))


@pytest.fixture(scope="module")
def ep_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPWorld]:
    """``tp_world`` (tests/server/worker/conftest.py) with the parallel state started under a MoE
    config, so vLLM also creates its expert-parallel group."""
    pytest.importorskip("vllm")
    world = TPWorld(tmp_path_factory.mktemp("ep"))
    kind, _ = _ep_model(world, "qwen3_moe")
    with single_process_world(world, world.models[kind].vllm_config):
        yield world


def _expert_maps(model: torch.nn.Module) -> dict[int, tuple[torch.Tensor, str]]:
    """Per layer: vLLM's own global -> local expert map and the experts module's name."""
    out: dict[int, tuple[torch.Tensor, str]] = {}
    for name, module in model.named_modules():
        expert_map = getattr(module, "expert_map", None)
        if isinstance(expert_map, torch.Tensor) and hasattr(module, "w13_weight"):
            layer = int(re.search(r"layers\.(\d+)\.", name).group(1))  # type: ignore[union-attr]
            out[layer] = (expert_map.clone(), name)
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_experts_land_once_where_vllm_puts_them(ep_world: TPWorld, family: str, ep: int) -> None:
    kind, params = _ep_model(ep_world, family)
    experts = {n: EXPERT_NAME.match(n) for n in params}
    experts = {n: m for n, m in experts.items() if m}
    assert len(experts) == 2 * EXPERTS * 3, sorted(params)
    base = random_checkpoint(params, seed=ep)
    patches, after = make_step(base, ep)
    held: dict[str, torch.Tensor] = {n: torch.zeros(params[n][0], dtype=torch.int32).reshape(-1)
                                     for n in experts}
    local_counts = []
    for rank in range(ep):
        where = f"{family} EP={ep} rank={rank}"
        live = ep_world.build(kind, ep, rank)
        maps = _expert_maps(live)
        assert sorted(maps) == [0, 1], where
        live.load_weights(iter(base.items()))  # vLLM's own loader, full checkpoint
        shardmap = ShardMap.from_model(live, params, loader=LOADER)
        local_counts.append(int((maps[0][0] >= 0).sum()))
        for name, m in experts.items():
            layer, expert = int(m.group(1)), int(m.group(2))
            expert_map, prefix = maps[layer]
            local = int(expert_map[expert])
            targets = shardmap.targets(name)
            if local < 0:
                assert targets == [] and "not on this rank" in shardmap.ignored[name], (where, name)
                continue
            assert name not in shardmap.ignored, (where, name)
            assert targets, (where, name)
            for t in targets:
                assert t.param_name.startswith(prefix + ".w"), (where, name, t.param_name)
                per_expert = t.param[0].numel()
                first, last = t.block.dst_offset, t.block.dst_offset + t.block.dst_extent
                assert first // per_expert == last // per_expert == local, (where, name)
                # what the map reads is what vLLM's loader wrote there
                got = t.param.detach().reshape(-1)[t.dst_indices()]
                want = base[name].reshape(-1)[t.block.src_indices()]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (where, name)
                held[name][t.block.src_indices()] += 1
        written = apply_patches(prepare(translate_all(shardmap, patches)))
        assert written > 0
        ref = ep_world.build(kind, ep, rank)
        ref.load_weights(iter(after.items()))
        assert_same_params(live, ref, where)
    assert sum(local_counts) == EXPERTS
    if ep == 8:  # 12 experts over 8 ranks: vLLM gives the first four ranks one more
        assert local_counts == [2, 2, 2, 2, 1, 1, 1, 1]
    for name, count in held.items():
        assert bool((count == 1).all()), f"{name}: elements held {count.unique().tolist()} times"


def test_ep_declined_experts_are_ignored_but_unknown_names_still_fail(ep_world: TPWorld) -> None:
    """Only a loader's explicit decline makes a name 'not on this rank'; a name no loader
    accepts (a misspelt expert) is still an error."""
    from vllm_deltasync.errors import ApplyError

    kind, params = _ep_model(ep_world, "qwen3_moe")
    live = ep_world.build(kind, 4, 0)
    shardmap = ShardMap.from_model(live, params, loader=LOADER)
    declined = [n for n, why in shardmap.ignored.items() if "not on this rank" in why]
    assert len(declined) == 2 * 9 * 3  # 9 of 12 experts elsewhere, 2 layers, 3 projections
    bad = dict(params)
    bad["model.layers.0.mlp.experts.3.gate_projx.weight"] = bad.pop(
        "model.layers.0.mlp.experts.3.gate_proj.weight")
    with pytest.raises(ApplyError, match="gate_projx"):
        ShardMap.from_model(live, bad, loader=LOADER)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("ep", [1, 2, 8])
def test_expert_families_placed_by_stride_equal_probing_every_name(
        ep_world: TPWorld, family: str, ep: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe places an expert family (experts 0..n-1 of one layer and projection) from
    three probed members when their blocks step by a constant offset and the parameter holds
    all n experts; the map is the same as probing every name. Under EP a rank's parameter
    holds fewer experts: every name is probed."""
    from vllm_deltasync.server.worker import _shardprobe

    kind, params = _ep_model(ep_world, family)
    outcomes: list[bool] = []
    extrapolate = _shardprobe._extrapolate

    def spy(*args: Any) -> bool:
        outcomes.append(extrapolate(*args))
        return outcomes[-1]

    monkeypatch.setattr(_shardprobe, "_extrapolate", spy)
    for rank in sorted({0, ep - 1}):
        where = f"{family} EP={ep} rank={rank}"
        live = ep_world.build(kind, ep, rank)
        fast = ShardMap.from_model(live, params, loader=LOADER)
        with monkeypatch.context() as m:
            m.setattr(_shardprobe, "MIN_FAMILY", 10**9)
            slow = ShardMap.from_model(live, params, loader=LOADER)
        assert fast.ignored == slow.ignored, where
        live.load_weights(iter(random_checkpoint(params, seed=rank).items()))  # loaders intact
        for name in params:
            got = [(t.param_name, t.block) for t in fast.targets(name)]
            want = [(t.param_name, t.block) for t in slow.targets(name)]
            assert got == want, (where, name)
    # 2 layers x 3 projections: placed by stride only where every expert is on the rank
    assert len(outcomes) == 6 * len({0, ep - 1}), outcomes
    assert all(outcomes) if ep == 1 else not any(outcomes), outcomes


def test_an_ep_rank_fetches_only_its_own_experts(ep_world: TPWorld, hub: Any,
                                                 make_hf_store: Any, run: Any) -> None:
    """Under EP a rank range-reads only the chunks of the experts it holds (Format v2 per-chunk
    ranges and sha256): counted in bytes at the local Hub server's CDN."""
    from vllm_deltasync import DeltaPublisher
    from vllm_deltasync.format.reader import BucketReader

    kind, params = _ep_model(ep_world, "qwen3_moe")
    base = random_checkpoint(params, seed=5)
    after = {n: t.clone() for n, t in base.items()}
    for t in after.values():  # a 1%-ish delta in every tensor
        bits = t.view(torch.int16).reshape(-1)
        bits[:: 97] += 1
    store = make_hf_store()
    options = {"endpoint": hub.endpoint, "token": hub.token, "environ": {},
               "uploader": store._uploader, "part_size": 1 << 16}
    with DeltaPublisher(store.url, store_options=options) as pub:
        pub.publish(0, base)
        pub.publish(1, after)
        pub.flush()
    live = ep_world.build(kind, 4, 1)
    shardmap = ShardMap.from_model(live, params, loader=LOADER)
    held = {n for n in params if shardmap.targets(n)}
    experts = {n for n in params if EXPERT_NAME.match(n)}
    assert experts - held and experts & held  # some experts here, most elsewhere

    def select(name: str) -> bool:
        return bool(shardmap.targets(name))

    reader = BucketReader(make_hf_store(bucket_id=store.bucket_id))

    async def fetch() -> tuple[Any, list[str]]:
        m = await reader.manifest(1)
        hub.cdn_bytes_served = 0
        names = [p.name async for p in reader.iter_patches(m, select=select)]
        return m, names

    m, names = run(fetch())
    assert set(names) == held  # every tensor changed: exactly the held ones come back
    wanted = reader.selected_bytes(m, select)
    total = sum(f.size for f in m.files)
    assert hub.cdn_bytes_served == wanted, (hub.cdn_bytes_served, wanted)
    assert wanted < 0.6 * total, (wanted, total)
    run(reader.close())

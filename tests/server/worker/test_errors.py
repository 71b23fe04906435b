"""What the shard map refuses, and what it ignores on purpose (each case explicit)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from tests.helpers.tp_world import TPWorld
from vllm_deltasync.errors import ApplyError
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.server.vllm.loaders import LOADER
from vllm_deltasync.server.worker.apply import (
    apply_patches,
    checkpoint_digest,
    prepare,
    tensor_digest,
)
from vllm_deltasync.server.worker.shardmap import ShardMap

INV_FREQ = "model.layers.0.self_attn.rotary_emb.inv_freq"


def test_unknown_name_is_an_error_naming_it(tp_world: TPWorld) -> None:
    params = tp_world.model("llama_gqa").checkpoint_params()
    params["model.layers.0.mlp.bogus_proj.weight"] = ((4, 4), "bfloat16")
    with pytest.raises(ApplyError, match=r"'model\.layers\.0\.mlp\.bogus_proj\.weight'"):
        ShardMap.from_model(tp_world.build("llama_gqa", 2, 1), params, loader=LOADER)


def test_wrong_shape_is_an_error_naming_it(tp_world: TPWorld) -> None:
    params = tp_world.model("llama_gqa").checkpoint_params()
    params["model.norm.weight"] = ((65,), "bfloat16")
    with pytest.raises(ApplyError, match=r"'model\.norm\.weight'"):
        ShardMap.from_model(tp_world.build("llama_gqa", 1, 0), params, loader=LOADER)


def test_tied_lm_head_is_covered_by_the_embedding(tp_world: TPWorld) -> None:
    params = tp_world.model("llama_tied").checkpoint_params()
    params["lm_head.weight"] = params["model.embed_tokens.weight"]
    shardmap = ShardMap.from_model(tp_world.build("llama_tied", 2, 1), params, loader=LOADER)
    assert shardmap.covered_by == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "tied" in shardmap.ignored["lm_head.weight"]
    patch = TensorPatch("lm_head.weight", (100, 64), torch.tensor([3, 4000]),
                        torch.ones(2, dtype=torch.bfloat16))
    assert shardmap.translate(patch) == []  # the embedding's own patch carries the change
    assert tensor_digest(shardmap, "lm_head.weight") == tensor_digest(
        shardmap, "model.embed_tokens.weight"
    )


def test_untied_lm_head_is_not_ignored(tp_world: TPWorld) -> None:
    params = tp_world.model("llama_gqa").checkpoint_params()
    shardmap = ShardMap.from_model(tp_world.build("llama_gqa", 2, 0), params, loader=LOADER)
    assert shardmap.ignored == {} and len(shardmap.targets("lm_head.weight")) == 1


def test_rotary_inv_freq_is_ignored_explicitly(tp_world: TPWorld) -> None:
    params = tp_world.model("qwen2_bias").checkpoint_params()
    params[INV_FREQ] = ((4,), "bfloat16")
    shardmap = ShardMap.from_model(tp_world.build("qwen2_bias", 2, 0), params, loader=LOADER)
    assert shardmap.ignored == {INV_FREQ: "buffer recomputed by the engine"}
    with pytest.raises(ApplyError, match="not held by the engine"):
        tensor_digest(shardmap, INV_FREQ)


class _Toy(torch.nn.Module):
    """A model whose load_weights does one odd thing per checkpoint name."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, w in weights:
            if name == "twice":  # one checkpoint tensor, two places (a, and b transposed)
                self.a.data.copy_(w)
                self.b.data.copy_(w.t())
            elif name == "scaled":
                self.a.data.copy_(w * 2)
            elif name == "replaced":
                self.a.data = w.to("cpu") if w.device.type != "meta" else torch.empty_like(self.a)
            elif name == "silent":
                pass
            elif name == "converted":  # dtype round trip, then copied whole: representable
                self.a.data.copy_(w.to(torch.float32))
            elif name == "moved":  # to the parameter's device (and dtype), then copied
                self.b.data.copy_(w.t().to(self.b.device, torch.float32))
            elif name in ("tied", "tied_alias"):
                self.a.data.copy_(w)
            elif name in ("top", "middle"):  # rows 0-2 and 1-3 of ``a``: element 1x of both
                self.a.data[(name == "middle") : (name == "middle") + 2].copy_(w[:2])
            elif name == "converted_view":
                self.a.data[:2].copy_(w.to(torch.float32)[2:])
        return set()


def _toy_map(name: str) -> ShardMap:
    return ShardMap.from_model(_Toy(), {name: ((4, 6), "bfloat16")}, loader=LOADER)


def test_one_element_in_several_places_returns_all() -> None:
    toy = _Toy()
    shardmap = ShardMap.from_model(toy, {"twice": ((4, 6), "bfloat16")}, loader=LOADER)
    patch = TensorPatch("twice", (4, 6), torch.tensor([1, 13]),
                        torch.tensor([5.0, 6.0], dtype=torch.bfloat16))
    pieces = shardmap.translate(patch)
    assert sorted(p.param.shape for p in pieces) == [(4, 6), (6, 4)]
    apply_patches(prepare(pieces))
    assert toy.a[0, 1] == 5 and toy.a[2, 1] == 6 and toy.b[1, 0] == 5 and toy.b[1, 2] == 6


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("scaled", "transforms its values"),
        ("replaced", "replaced the storage"),
        ("silent", "wrote nothing"),
        ("converted_view", "converted copy"),
    ],
)
def test_loaders_it_cannot_represent_are_errors(name: str, match: str) -> None:
    toy = _Toy()
    with pytest.raises(ApplyError, match=match) as info:
        ShardMap.from_model(toy, {name: ((4, 6), "bfloat16")}, loader=LOADER)
    assert repr(name) in str(info.value)
    assert toy.a.shape == (4, 6) and toy.a.device.type == "cpu"  # restored after "replaced"


def test_two_names_writing_the_same_place() -> None:
    shardmap = ShardMap.from_model(_Toy(), {n: ((4, 6), "bfloat16") for n in ("tied", "tied_alias")}, loader=LOADER)
    assert shardmap.covered_by == {"tied_alias": "tied"}  # applied once, never twice
    with pytest.raises(ApplyError, match="'top' and 'middle' both write 'a'"):
        ShardMap.from_model(_Toy(), {n: ((4, 6), "bfloat16") for n in ("top", "middle")}, loader=LOADER)


def test_whole_tensor_dtype_conversion_is_followed() -> None:
    shardmap = _toy_map("converted")
    (target,) = shardmap.targets("converted")
    assert target.param_name == "a" and target.block.sizes == (24,)


def test_device_move_is_followed() -> None:
    toy = _Toy()
    shardmap = ShardMap.from_model(toy, {"moved": ((4, 6), "bfloat16")}, loader=LOADER)
    patch = TensorPatch("moved", (4, 6), torch.tensor([1, 13]),
                        torch.tensor([5.0, 6.0], dtype=torch.bfloat16))
    apply_patches(prepare(shardmap.translate(patch)))
    assert toy.b[1, 0] == 5 and toy.b[1, 2] == 6 and int((toy.b != 0).sum()) == 2


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        (TensorPatch("twice", (6, 4), None, torch.zeros(24, dtype=torch.bfloat16)), "shape"),
        (TensorPatch("twice", (4, 6), None, torch.zeros(24)), "float32"),
        (TensorPatch("twice", (4, 6), torch.tensor([3, 2]), torch.zeros(2, dtype=torch.bfloat16)),
         "increasing"),
        (TensorPatch("twice", (4, 6), torch.tensor([24]), torch.zeros(1, dtype=torch.bfloat16)),
         "outside"),
        (TensorPatch("twice", (4, 6), None, torch.zeros(5, dtype=torch.bfloat16), offset=20),
         "exceeds"),
        (TensorPatch("other", (4, 6), None, torch.zeros(24, dtype=torch.bfloat16)),
         "not in the parameter set"),
        (TensorPatch("twice", (4, 6), torch.tensor([1]), torch.zeros(1, dtype=torch.bfloat16),
                     relative=True), "int16"),
    ],
)
def test_bad_patches_are_refused(patch: TensorPatch, match: str) -> None:
    with pytest.raises(ApplyError, match=match):
        _toy_map("twice").translate(patch)


def test_json_round_trip_translates_the_same(tp_world: TPWorld) -> None:
    params = tp_world.model("qwen2_bias").checkpoint_params()
    model = tp_world.build("qwen2_bias", 4, 3)
    shardmap = ShardMap.from_model(model, params, loader=LOADER)
    again = ShardMap.from_json(shardmap.to_json(), dict(model.named_parameters()))
    gen = torch.Generator().manual_seed(0)
    for name, (shape, _) in params.items():
        numel = torch.Size(shape).numel()
        idx = (torch.rand(numel, generator=gen) < 0.1).nonzero().squeeze(1)
        patch = TensorPatch(name, shape, idx, torch.randn(idx.numel()).to(torch.bfloat16))
        for a, b in zip(shardmap.translate(patch), again.translate(patch), strict=True):
            assert a.param is b.param and torch.equal(a.indices, b.indices)
        full = torch.randn(shape).to(torch.bfloat16)
        assert checkpoint_digest(shardmap, name, full) == checkpoint_digest(again, name, full)

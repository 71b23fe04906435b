"""Merged LoRA weights (trainer/lora.py ``merged_tensors``) against PEFT's own
``merge_and_unload()`` on a deep copy, bit for bit, for every LoRA variant PEFT merges, on a
tiny Llama trained a few AdamW steps (so ``B`` is not zero); the training model is left as it
was. Real peft, no mocks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.helpers.lora import LoraTrainer, bits, lora_model, snapshot, tiny_llama

pytest.importorskip("peft", reason="the LoRA tests need peft (the 'lora' extra)")

from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402

from vllm_deltasync.trainer.lora import base_parameters, merged_tensors  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "lora": {},
    "rslora": {"use_rslora": True, "lora_alpha": 16},
    "dora": {"use_dora": True},
    "pissa": {"init_lora_weights": "pissa"},
    "olora": {"init_lora_weights": "olora"},
    "modules_to_save": {"modules_to_save": ["lm_head"]},
    "lora_bias": {"family": "qwen2", "target_modules": ["q_proj", "k_proj"], "lora_bias": True},
    "tied_embedding": {"tie": True, "target_modules": ["q_proj", "embed_tokens"]},
    "bf16_adapter": {"adapter_dtype": torch.bfloat16},
}


def _trained(steps: int = 5, **config: Any) -> torch.nn.Module:
    model = lora_model(**config)
    trainer = LoraTrainer(model)
    for _ in range(steps):
        trainer.step()
    return model


def _assert_same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(bits(a), bits(b)), f"{name}: merged bits differ from merge_and_unload's"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_merged_tensors_are_merge_and_unload_bit_for_bit(variant: str) -> None:
    model = _trained(**VARIANTS[variant])
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(bool(p.ne(0).any()) for p in lora_b)  # trained: B is not zero
    before = snapshot(model)

    got = list(merged_tensors(model))

    after = snapshot(model)  # the training model is not written: no merge/unmerge round trip
    assert list(before) == list(after)
    assert all(torch.equal(bits(before[n]), bits(after[n])) for n in before)
    assert not any(layer.merged for layer in model.modules() if isinstance(layer, BaseTunerLayer))
    reference = copy.deepcopy(model).merge_and_unload()
    want = [(n, p.detach()) for n, p in reference.named_parameters()]
    _assert_same(got, want)
    assert base_parameters(model) == [(n, tuple(t.shape)) for n, t in want]
    # the names are the base checkpoint's, and the merge did change the adapted weights
    base = tiny_llama(tie=VARIANTS[variant].get("tie", False),
                      family=VARIANTS[variant].get("family", "llama"))
    assert [n for n, _ in got] == [n for n, _ in base.named_parameters()]
    merged = dict(got)
    adapted = [n for n in merged if any(t in n for t in ("q_proj", "embed_tokens", "lm_head"))]
    assert any(not torch.equal(bits(merged[n]), bits(dict(base.named_parameters())[n].detach()))
               for n in adapted)


def test_two_active_adapters_are_merged_in_order() -> None:
    model = lora_model(family="qwen2", target_modules=["q_proj"])
    model.add_adapter("second", type(model.peft_config["default"])(
        r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True))
    model.base_model.set_adapter(["default", "second"])
    trainer = LoraTrainer(model)
    for _ in range(5):
        trainer.step()
    got = list(merged_tensors(model))
    reference = copy.deepcopy(model).merge_and_unload()
    _assert_same(got, [(n, p.detach()) for n, p in reference.named_parameters()])


def test_merging_again_gives_the_same_bits_and_follows_training() -> None:
    model = _trained()
    first = list(merged_tensors(model))
    again = list(merged_tensors(model))
    _assert_same(again, first)
    LoraTrainer(model, seed=1).step()
    moved = dict(merged_tensors(model))
    assert not torch.equal(bits(moved["model.layers.0.self_attn.q_proj.weight"]),
                           bits(dict(first)["model.layers.0.self_attn.q_proj.weight"]))
    assert torch.equal(bits(moved["model.layers.0.self_attn.k_proj.weight"]),  # not adapted
                       bits(dict(first)["model.layers.0.self_attn.k_proj.weight"]))


@pytest.mark.parametrize("kind", ["llama", "own_base_layer"])
def test_a_plain_module_gives_its_named_parameters(kind: str) -> None:
    if kind == "llama":
        model = tiny_llama()
    else:  # a module of its own that happens to name a child base_layer: not PEFT's
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        model[0].base_layer = torch.nn.Linear(4, 2)  # type: ignore[assignment]
    got = list(merged_tensors(model))
    want = list(model.named_parameters())
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(a.data_ptr() == b.data_ptr() for (_, a), (_, b) in zip(got, want, strict=True))

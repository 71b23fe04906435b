"""Tiny PEFT models built and trained here (no download): the LoRA tests of the trainer."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 100


def tiny_llama(*, seed: int = 0, tie: bool = False, family: str = "llama") -> torch.nn.Module:
    """A 2-layer Llama (or Qwen2: q/k/v biases) in bf16, random, built from its config."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    kind = Qwen2Config if family == "qwen2" else LlamaConfig
    config = kind(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=128, vocab_size=VOCAB, tie_word_embeddings=tie,
                  max_position_embeddings=256)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


def lora_model(*, seed: int = 0, tie: bool = False, family: str = "llama",
               adapter_dtype: torch.dtype | None = None, **config: Any) -> torch.nn.Module:
    """``tiny_llama`` wrapped by ``peft.get_peft_model`` with ``LoraConfig(**config)`` (rank 4,
    alpha 8 on q/v/down_proj unless given); ``adapter_dtype=torch.bfloat16`` keeps the adapter
    in bf16 (PEFT's default: float32)."""
    import peft  # the LoRA test modules skip without it; the other trainer tests never need it

    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], **config}
    base = tiny_llama(seed=seed, tie=tie, family=family)
    model = peft.get_peft_model(base, peft.LoraConfig(**config),
                                autocast_adapter_dtype=adapter_dtype is None)
    return model


class LoraTrainer:
    """Real AdamW steps on a PEFT model's trainable parameters (the adapter, modules_to_save)."""

    def __init__(self, model: torch.nn.Module, *, lr: float = 1e-3, seed: int = 0) -> None:
        self.model = model
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                     weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        ids = torch.randint(2, VOCAB, (2, 16), generator=self.gen)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a floating tensor (NaN-safe, -0.0 != 0.0): compare these for equality."""
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(view)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter and buffer of ``model``, by state-dict name."""
    return {n: t.detach().clone() for n, t in model.state_dict(keep_vars=True).items()}

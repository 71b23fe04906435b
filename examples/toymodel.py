"""Small Hugging Face checkpoints built locally, for tests, the demo and benchmarks.

Nothing is downloaded: the model is a ``transformers`` config with a random initialisation
shaped like a real model (normal(0, 0.02) matrices, norms and biases that are not all equal),
saved in bf16 safetensors, and the tokenizer is a byte-level BPE trained here with
``tokenizers`` on generated text, so vLLM can serve the directory as it is.

    path = build_model(tmp_path / "llama", family="llama")
    model = load_hf_model(path)            # transformers model in bf16, eval mode

vLLM's CPU attention needs a head size of at least 32, so the defaults give
``hidden_size // num_heads == 32``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

import torch

from vllm_deltasync.errors import ConfigError

Family = Literal["llama", "qwen2", "qwen3_moe", "mixtral"]
"""``qwen3_moe`` and ``mixtral`` are mixture-of-experts shapes: per-expert checkpoint tensors
(``mlp.experts.<e>.gate_proj`` / ``block_sparse_moe.experts.<e>.w1`` ...), fused by vLLM into
``w13_weight`` / ``w2_weight``."""

_WORDS = ["the", "a", "policy", "gradient", "reward", "model", "token", "step", "update", "weight", "delta", "bucket", "server", "rollout", "trainer", "value", "advantage", "learning", "rate", "batch", "sample", "prompt", "answer", "because", "when", "then", "after", "before", "every", "each", "some", "many", "few", "more", "less", "small", "large", "fast", "slow", "red", "green", "blue", "river", "mountain", "city", "house", "garden", "window", "door", "table", "chair", "paper", "write", "read", "send", "receive", "open", "close", "start", "stop", "run", "walk", "think", "know", "see", "hear", "say"]


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return out


def _train_tokenizer(out_dir: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|bos|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({k: cfg[k] for k in ("bos_token", "eos_token", "pad_token")}, indent=2)
    )


def _hf_config(family: Family, moe: dict[str, int], **kw: Any) -> Any:
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        kw.setdefault("head_dim", 32)  # an init argument the config's type hints leave out
        return Qwen3MoeConfig(num_experts=moe["num_experts"],
                              num_experts_per_tok=moe["experts_per_token"],
                              moe_intermediate_size=moe["moe_intermediate_size"],
                              decoder_sparse_step=1, norm_topk_prob=True, **kw)
    if family == "mixtral":
        from transformers import MixtralConfig

        kw["intermediate_size"] = moe["moe_intermediate_size"]
        return MixtralConfig(num_local_experts=moe["num_experts"],
                             num_experts_per_tok=moe["experts_per_token"], **kw)
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**kw)
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**kw)
    raise ConfigError(f"toy model family {family!r} is unknown; use 'llama', 'qwen2', "
                      "'qwen3_moe' or 'mixtral'")


@torch.no_grad()
def _init_like_real(model: torch.nn.Module, seed: int) -> None:
    """Matrices normal(0, 0.02); norms around 1 and biases around 0, but not constant."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        elif "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))


def build_model(
    out_dir: str | Path,
    family: Family = "llama",
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 500,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    num_experts: int = 8,
    experts_per_token: int = 2,
    moe_intermediate_size: int = 64,
) -> Path:
    """Write a servable HF checkpoint directory (config, bf16 safetensors, tokenizer).

    The default vocabulary (500) is not a multiple of 64, so vLLM pads the vocab-parallel
    embedding and lm_head. Qwen2 checkpoints have q/k/v biases. MoE families use
    ``num_experts``, ``experts_per_token`` and ``moe_intermediate_size`` (per expert; vLLM's CPU
    MoE kernel pads a per-rank intermediate size that is not a multiple of 32). Returns
    ``out_dir``.
    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ConfigError(
            f"toy model: hidden_size={hidden_size} must divide by num_heads={num_heads}, "
            f"and num_heads by num_kv_heads={num_kv_heads}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(out, vocab_size, seed)
    moe = {"num_experts": num_experts, "experts_per_token": experts_per_token,
           "moe_intermediate_size": moe_intermediate_size}
    config = _hf_config(
        family,
        moe,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=0,
        pad_token_id=0,
        torch_dtype="bfloat16",
    )
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    _init_like_real(model, seed)
    model = model.to(torch.bfloat16)
    if tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_eagle_head(out_dir: str | Path, target_dir: str | Path, *, seed: int = 0) -> Path:
    """An EAGLE-1 draft head for the Llama checkpoint ``target_dir`` (vLLM's
    ``speculative_config={"method": "eagle", "model": out_dir, ...}``): one decoder layer and
    ``fc`` (hidden x 2 hidden), random; no embedding, norm or lm_head (vLLM shares the
    target's), and no layer-0 ``input_layernorm`` (EAGLE-1 has none). Returns ``out_dir``."""
    from safetensors.torch import save_file

    config = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(
        {**config, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {
        "fc.weight": normal(hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": normal(hidden, hidden),
        "layers.0.self_attn.k_proj.weight": normal(kv, hidden),
        "layers.0.self_attn.v_proj.weight": normal(kv, hidden),
        "layers.0.self_attn.o_proj.weight": normal(hidden, hidden),
        "layers.0.mlp.gate_proj.weight": normal(inter, hidden),
        "layers.0.mlp.up_proj.weight": normal(inter, hidden),
        "layers.0.mlp.down_proj.weight": normal(hidden, inter),
        "layers.0.post_attention_layernorm.weight":
            (1 + torch.randn(hidden, generator=gen) * 0.1).to(torch.bfloat16),
    }
    save_file(tensors, str(out / "model.safetensors"))
    return out


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Load a checkpoint directory written by :func:`build_model` (or any HF causal LM)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    return model


__all__ = ["Family", "build_model", "load_hf_model"]

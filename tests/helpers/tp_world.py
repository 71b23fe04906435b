"""vLLM's own model classes at any TP rank, without an engine (the rank's shard-map, apply and
staging tests; the ``tp_world`` fixture is in tests/server/worker/conftest.py).

vLLM's layers read their rank from ``get_tp_group().world_size / .rank_in_group``. We start a
single-process gloo world (``init_distributed_environment`` + ``initialize_model_parallel``),
then set those two attributes of the TP group to the rank being simulated while a model is
constructed: test scaffolding patching vLLM, never our code. Construction and ``load_weights``
need no collective, so every rank of TP = 1, 2, 4, 8 can be built in this one process.

vLLM is imported only inside functions, so the GPU test module (torch + safetensors only) can
import this module on machines without vLLM.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_deltasync.format.codec import TensorPatch

# name -> (transformers config class, config kwargs). Shapes chosen so that:
#  llama_gqa:  8 heads / 4 KV heads, vocab 128 (divides every TP; KV replicated at TP=8)
#  qwen2_bias: QKV bias, 2 KV heads (replicated at TP=4, 8), vocab 100 (padded at TP>1)
#  llama_tied: tied embeddings, 1 KV head (replicated at every TP>1), vocab 100
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_gqa": ("LlamaConfig", dict(vocab_size=128, num_key_value_heads=4)),
    "qwen2_bias": ("Qwen2Config", dict(vocab_size=100, num_key_value_heads=2)),
    "llama_tied": (
        "LlamaConfig",
        dict(vocab_size=100, num_key_value_heads=1, tie_word_embeddings=True),
    ),
}
COMMON = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
    max_position_embeddings=128, torch_dtype="bfloat16",
)
# 7B shapes with one decoder layer, recorded at TP=2 for the GPU test (which has no vLLM).
SEVEN_B: dict[str, tuple[str, dict[str, Any]]] = {
    "llama2_7b": ("LlamaConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
        num_key_value_heads=32, num_hidden_layers=32)),
    "qwen2_7b": ("Qwen2Config", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
        num_key_value_heads=4, num_hidden_layers=28)),
}
RECORDED = Path(__file__).resolve().parents[1] / "data" / "shardmaps"
"""The recorded 7B-shaped shard maps (``test_recorded_maps.py`` writes, the GPU test reads)."""

VLLM_CLASSES = {
    "LlamaConfig": ("vllm.model_executor.models.llama", "LlamaForCausalLM"),
    "Qwen2Config": ("vllm.model_executor.models.qwen2", "Qwen2ForCausalLM"),
}


@dataclass
class TinyModel:
    kind: str
    hf_config: Any
    vllm_config: Any
    vllm_cls: type

    def checkpoint_params(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Names and shapes of the Hugging Face checkpoint, as ``save_pretrained`` writes it."""
        import transformers

        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(self.hf_config)
        names = {n: (tuple(p.shape), "bfloat16") for n, p in hf.state_dict().items()}
        if self.hf_config.tie_word_embeddings:
            names.pop("lm_head.weight")
        return names


class TPWorld:
    """Builds vLLM models as TP rank ``rank`` of ``size`` inside one process."""

    def __init__(self, tmp: Any) -> None:
        self.tmp = tmp
        self.models: dict[str, TinyModel] = {}

    def model(self, kind: str) -> TinyModel:
        if kind not in self.models:
            import importlib

            import transformers
            from vllm.config import ModelConfig, VllmConfig

            if kind in MODELS:
                cfg_name, kw = MODELS[kind]
                cfg = getattr(transformers, cfg_name)(**{**COMMON, **kw})
            else:  # 7B shapes, one layer (params are torch.empty: no pages touched)
                cfg_name, kw = SEVEN_B[kind]
                cfg = getattr(transformers, cfg_name)(
                    **{**kw, "num_hidden_layers": 1, "torch_dtype": "bfloat16"}
                )
            path = self.tmp / kind
            cfg.save_pretrained(path)
            mc = ModelConfig(model=str(path), dtype="bfloat16", skip_tokenizer_init=True,
                             enforce_eager=True)
            module, cls = VLLM_CLASSES[cfg_name]
            vllm_cls = getattr(importlib.import_module(module), cls)
            self.models[kind] = TinyModel(kind, cfg, VllmConfig(model_config=mc), vllm_cls)
        return self.models[kind]

    def build(self, kind: str, size: int, rank: int) -> torch.nn.Module:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state

        tiny = self.model(kind)
        group = parallel_state.get_tp_group()
        saved = (group.world_size, group.rank_in_group, torch.get_default_dtype())
        try:
            group.world_size, group.rank_in_group = size, rank
            torch.set_default_dtype(torch.bfloat16)
            # attention layers register by name; each build is a fresh model
            tiny.vllm_config.compilation_config.static_forward_context.clear()
            with set_current_vllm_config(tiny.vllm_config):
                return tiny.vllm_cls(vllm_config=tiny.vllm_config)
        finally:
            group.world_size, group.rank_in_group = saved[0], saved[1]
            torch.set_default_dtype(saved[2])


@contextlib.contextmanager
def single_process_world(world: TPWorld, vllm_config: Any) -> Iterator[TPWorld]:
    """vLLM's parallel state for one process (gloo), started under ``vllm_config`` (a MoE config
    also makes vLLM create its expert-parallel group), torn down afterwards."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"file://{world.tmp / 'dist_init'}",
        )
        parallel_state.initialize_model_parallel(1, 1)
    try:
        yield world
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def random_checkpoint(
    params: dict[str, tuple[tuple[int, ...], str]], seed: int
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen).to(torch.bfloat16) for n, (shape, _) in params.items()}


def live_checkpoint(world: TPWorld, tmp: Path, kind: str,
                    seed: int) -> tuple[Path, torch.nn.Module, dict[str, torch.Tensor]]:
    """A random checkpoint of ``kind`` saved under ``tmp/ckpt`` (the directory a worker's
    ``model_config.model`` names) and vLLM's model (TP=1) loaded from it: (checkpoint
    directory, live model, the checkpoint's tensors)."""
    from safetensors.torch import save_file

    weights = random_checkpoint(world.model(kind).checkpoint_params(), seed=seed)
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    save_file(weights, str(ckpt / "model.safetensors"))
    live: Any = world.build(kind, 1, 0)  # a vLLM model: load_weights
    live.load_weights(iter(weights.items()))
    return ckpt, live, weights


def state_bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter's bit pattern (int16 view of bf16)."""
    return {n: p.detach().view(torch.int16).clone() for n, p in model.named_parameters()}


def sha256_bytes(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return "sha256:" + hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def target_rank(model: torch.nn.Module, ckpt: Path, config: Any, *, row: Any = None,
                weights: tuple[torch.nn.Module, Path] | None = None,
                drafter: tuple[torch.nn.Module, Path] | None = None,
                bucket_params: Any = None) -> Any:
    """A real ``TargetRank`` of target ``row`` (the policy by default) on a rank whose policy is
    ``model`` loaded from ``ckpt`` (``drafter``: the draft model it also runs), with vLLM's own
    loaders for the shard-map probe."""
    from vllm_deltasync.server.targets import POLICY
    from vllm_deltasync.server.vllm.loaders import LOADER
    from vllm_deltasync.server.worker.target import TargetRank
    from vllm_deltasync.server.worker.view import WorkerView

    row = POLICY if row is None else row
    view = WorkerView(rank=0, model=model, model_path=str(ckpt), loader=LOADER,
                      drafter=None if drafter is None else (drafter[0], str(drafter[1])))
    mine = (model, str(ckpt)) if weights is None else (weights[0], str(weights[1]))
    return TargetRank(view, row, row.source(config), mine, bucket_params=bucket_params)


MODES = ("sparse", "relative", "dense", "runs", "relative_dense", "unchanged")


def _bits_diff(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    diff = new.view(torch.int16).to(torch.int32) - old.view(torch.int16).to(torch.int32)
    return (((diff + 32768) % 65536) - 32768).to(torch.int16)


def make_step(
    full: dict[str, torch.Tensor], step: int
) -> tuple[list[TensorPatch], dict[str, torch.Tensor]]:
    """One published step: a mix of encodings over the tensors, and the full result."""
    gen = torch.Generator().manual_seed(1000 + step)
    patches, after = [], {}
    for i, name in enumerate(sorted(full)):
        old = full[name]
        flat = old.reshape(-1)
        mode = MODES[(i + step) % len(MODES)]
        new = flat.clone()
        if mode in ("sparse", "relative"):
            idx = (torch.rand(flat.numel(), generator=gen) < 0.05).nonzero().squeeze(1)
            new[idx] = torch.randn(idx.numel(), generator=gen).to(torch.bfloat16)
            values = _bits_diff(new[idx], flat[idx]) if mode == "relative" else new[idx].clone()
            patches.append(TensorPatch(name, tuple(old.shape), idx, values, relative=mode == "relative"))
        elif mode in ("dense", "runs", "relative_dense"):
            new = torch.randn(flat.numel(), generator=gen).to(torch.bfloat16)
            relative = mode == "relative_dense" or (mode == "runs" and step % 2 == 1)
            values = _bits_diff(new, flat) if relative else new
            cuts = [0, flat.numel()] if mode != "runs" else [0, 7, flat.numel() // 3 + 1, flat.numel()]
            for a, b in zip(cuts, cuts[1:], strict=False):
                patches.append(
                    TensorPatch(name, tuple(old.shape), None, values[a:b].clone(), offset=a,
                                relative=relative)
                )
        after[name] = new.reshape(old.shape)
    return patches, after


def assert_same_params(live: torch.nn.Module, ref: torch.nn.Module, where: str) -> None:
    want = state_bits(ref)
    for name, bits in state_bits(live).items():
        assert torch.equal(bits, want[name]), f"{where}: {name} differs from vLLM's loader"

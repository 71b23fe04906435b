"""Shared helpers of the engine tests: a real trainer, real vLLM engines, a real file:// bucket.

Engine tests start vLLM (the CPU build here) in this process with the extension configured the
way a user would: ``worker_extension_cls`` plus ``VLLM_DELTASYNC_*`` environment variables.
Nothing calls ``deltasync_start``: the plugin starts everything by itself.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_deltasync.toymodel import load_hf_model

EXTENSION = "vllm_deltasync.DeltaSyncExtension"


def has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


requires_vllm = pytest.mark.skipif(not has_vllm(), reason="vllm is not installed")


class Trainer:
    """Real AdamW steps in bf16 on a locally built model (what an RL trainer publishes)."""

    def __init__(self, model_dir: Path, *, lr: float = 2e-4, seed: int = 0) -> None:
        self.model = load_hf_model(model_dir)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = self.model.config.vocab_size
        self.tokenizer_dir = model_dir

    def step(self) -> None:
        ids = torch.randint(2, self.vocab, (4, 32), generator=self.gen)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def save(self, out_dir: Path) -> Path:
        """A servable checkpoint of the current weights (config, safetensors, tokenizer)."""
        import shutil

        self.model.save_pretrained(out_dir, safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(self.tokenizer_dir / f, out_dir / f)
        return out_dir


@contextlib.contextmanager
def engine_env(tmp: Path, tp: int, **deltasync: Any) -> Iterator[None]:
    """Environment for one vLLM engine: private cache/IPC dirs, small KV cache, deltasync vars."""
    import tempfile

    rpc = tempfile.mkdtemp(prefix="vrpc")  # unix socket paths must stay under 107 bytes
    env = {
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_RPC_BASE_PATH": rpc,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "0",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.update({f"VLLM_DELTASYNC_{k.upper()}": str(v) for k, v in deltasync.items()})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        import shutil

        shutil.rmtree(rpc, ignore_errors=True)


def make_llm(model_dir: Path, tp: int, *, extension: bool) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {"worker_extension_cls": EXTENSION} if extension else {}
    return LLM(model=str(model_dir), tensor_parallel_size=tp, enforce_eager=True,
               max_model_len=1024, dtype="bfloat16", seed=0, enable_prefix_caching=True,
               max_num_seqs=8, **kw)


def close_llm(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def engine_status(llm: Any) -> dict[str, Any]:
    return llm.llm_engine.engine_core.call_utility("deltasync_engine_status")


def wait_applied(llm: Any, step: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Wait until every rank reports ``step`` applied (the engine switches by itself)."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = llm.collective_rpc("deltasync_status")
        if all(s["applied_step"] == step for s in statuses):
            return statuses
        if time.monotonic() > deadline:
            raise AssertionError(f"step {step} not applied after {timeout_s}s: {statuses}")
        time.sleep(0.1)


def long_prompts(n: int = 3, words: int = 160, seed: int = 0) -> list[str]:
    """Prompts longer than one 128-token KV block, so prefix-cache blocks fill."""
    import random

    rng = random.Random(seed)
    vocab = ["the", "policy", "reward", "model", "step", "update", "weight", "bucket", "server", "rollout", "trainer", "value", "batch", "sample", "prompt", "answer", "river", "mountain", "city", "house", "garden", "window"]
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def generate(llm: Any, prompts: list[str]) -> list[dict[str, Any]]:
    """Greedy continuation and prompt logprobs (what must match a fresh engine)."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    plp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = []
    for g, p in zip(llm.generate(prompts, greedy, use_tqdm=False),
                    llm.generate(prompts, plp, use_tqdm=False), strict=True):
        lps = [next(iter(d.values())).logprob for d in p.prompt_logprobs[1:]]
        out.append({"tokens": list(g.outputs[0].token_ids), "prompt_logprobs": lps,
                    "weight_versions": g.outputs[0].weight_versions})
    return out

"""Whether this host runs a stock vLLM engine of one kind:
``python -m tests.helpers.host_probe KIND DIR``.

Started once per test session and kind by tests/helpers/hosts.py (``engine_probe``), only when a
test that needs that kind runs. The engine is vLLM's own, as a user without deltasync starts
it: tests/helpers/hosts.py sets ``VLLM_PLUGINS`` to a name no plugin has and drops every
``VLLM_DELTASYNC_*`` variable. Its engine core and worker run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a kernel the CPU traps kills this process with
SIGILL, and faulthandler prints the Python frames it died in.

The first request is one token: its forward runs no oneDNN or torch matrix kernel that could
ask Linux for AMX tiles before vLLM's own attention runs (a process that has not asked dies of
SIGILL there; tests/startup/sitecustomize.py). A batch of two longer prompts follows. Prints
``PROBE {...}`` (the tokens) on success.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path
from typing import Any

KINDS: dict[str, str] = {
    "toy": "the toy Llama of examples/toymodel.py (head size 32)",
    "draft_model": "the toy Llama with a 1-layer toy Llama draft (speculative_config method "
                   "'draft_model', 3 tokens)",
    "moe": "a toy Qwen3-MoE (vLLM's CPU fused-MoE experts)",
    "lora": "the toy Llama with --enable-lora serving a rank-8 LoRA adapter (vLLM's CPU LoRA "
            "kernels)",
}
"""The kinds of engine probed, as the skip reasons name them."""


def engine_args(kind: str, work: Path) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for ``kind``, its toy checkpoints built under ``work``."""
    from examples.toymodel import build_model

    if kind == "toy":
        return {"model": str(build_model(work / "toy", "llama"))}
    if kind == "draft_model":
        draft = build_model(work / "draft", "llama", num_layers=1)
        return {"model": str(build_model(work / "policy", "llama")),
                "speculative_config": {"method": "draft_model", "model": str(draft),
                                       "num_speculative_tokens": 3}}
    if kind == "moe":
        return {"model": str(build_model(work / "moe", "qwen3_moe", moe_intermediate_size=64))}
    if kind == "lora":
        return {"model": str(build_model(work / "toy", "llama")), "enable_lora": True,
                "max_lora_rank": 8}
    raise SystemExit(f"unknown engine kind {kind!r}; known: {', '.join(KINDS)}")


def main(kind: str, work: Path) -> None:
    faulthandler.enable()
    args = engine_args(kind, work)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0, max_num_seqs=4,
              kv_cache_memory_bytes=32 << 20, **args)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    lora = _probe_adapter(work) if kind == "lora" else None
    first = llm.generate([TokensPrompt(prompt_token_ids=[7])], params, use_tqdm=False, lora_request=lora)
    batch = llm.generate(["the policy reward model step update weight bucket",
                          "river mountain city house garden"], params, use_tqdm=False,
                         lora_request=lora)
    tokens = [list(o.outputs[0].token_ids) for o in [*first, *batch]]
    print("PROBE " + json.dumps({"kind": kind, "tokens": tokens}), flush=True)


def _probe_adapter(work: Path) -> Any:
    """A rank-8 LoRA on the toy Llama's q_proj, written as PEFT writes one (no peft needed)."""
    import torch
    from safetensors.torch import save_file
    from vllm.lora.request import LoRARequest

    path = work / "adapter"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
         "bias": "none"}))
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(2):
        key = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{key}.lora_A.weight"] = torch.randn(8, 128, generator=gen).to(torch.bfloat16)
        tensors[f"{key}.lora_B.weight"] = torch.randn(128, 8, generator=gen).to(torch.bfloat16)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return LoRARequest("probe", 1, str(path))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))

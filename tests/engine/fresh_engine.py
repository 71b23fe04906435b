"""Reference outputs from fresh, stock vLLM engines: one new engine per checkpoint.

Run in its own process by the engine tests (``python -m tests.engine.fresh_engine SPEC OUT``)
so every engine is built from nothing: a new ``LLM`` per checkpoint directory, without the
extension (so the CPU build prepacks its Linear weights as it would for any user), loading
the trainer's checkpoint of that step through vLLM's own loader, with an empty prefix cache.
The process imports vLLM once; at TP=1 the engine core and the worker run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor), which only saves the start-up
of two processes per engine: the kernels and the loader are the same.

VLLM_CACHE_ROOT comes from the caller. SPEC is JSON: ``{"tp": 1, "prompts": [...], "checkpoints": ["/path/ckpt-1", ...]}``; OUT
receives ``{checkpoint: generate(...) outputs}`` (weight versions dropped).

LoRA references (tests/engine/test_lora_*.py): SPEC ``{"tp": 1, "model": "/path/base",
"prompts": [[token ids], ...], "tokens": 12, "max_rank": 8, "adapters": {"label": "/peft/dir"}}``:
one fresh ``--enable-lora`` engine of the base model, every adapter directory given to it as
vLLM's own ``LoRARequest`` (a different id each), each prompt generated alone; OUT receives
``{label: [{"tokens": [...], "prompt_logprobs": [...]}, ...]}``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.helpers.cores import engine_cores


def reference_outputs(tp: int, prompts: list[str], checkpoints: list[str]) -> dict[str, Any]:
    from vllm import LLM

    from tests.helpers.engines import close_llm, generate

    results: dict[str, Any] = {}
    for ckpt in checkpoints:
        llm = LLM(model=ckpt, tensor_parallel_size=tp, enforce_eager=True, max_model_len=1024,
                  dtype="bfloat16", seed=0, enable_prefix_caching=True, max_num_seqs=8,
                  distributed_executor_backend="uni" if tp == 1 else "mp")
        try:
            outputs = generate(llm, prompts)
        finally:
            close_llm(llm)
        results[ckpt] = [{k: v for k, v in o.items() if k != "weight_versions"} for o in outputs]
    return results


def lora_reference_outputs(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from tests.helpers.engines import close_llm

    tp = int(spec["tp"])
    adapters = dict(spec["adapters"])
    llm = LLM(model=spec["model"], tensor_parallel_size=tp, enforce_eager=True,
              max_model_len=512, dtype="bfloat16", seed=0, max_num_seqs=4,
              enable_lora=True, max_lora_rank=int(spec["max_rank"]), max_loras=1,
              max_cpu_loras=len(adapters) + 1,
              distributed_executor_backend="uni" if tp == 1 else "mp")
    params = SamplingParams(temperature=0.0, max_tokens=int(spec["tokens"]), ignore_eos=True,
                            prompt_logprobs=0)
    results: dict[str, Any] = {}
    try:
        for i, (label, path) in enumerate(sorted(adapters.items())):
            lora = LoRARequest(label, i + 1, path)
            out = []
            for prompt in spec["prompts"]:
                [res] = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=lora,
                                     use_tqdm=False)
                lps = [next(iter(d.values())).logprob for d in res.prompt_logprobs[1:]]
                out.append({"tokens": list(res.outputs[0].token_ids), "prompt_logprobs": lps})
            results[label] = out
    finally:
        close_llm(llm)
    return results


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    tp = int(spec["tp"])
    rpc = tempfile.mkdtemp(prefix="vrpc")  # unix socket paths must stay under 107 bytes
    os.environ.update({
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": engine_cores(tp),
        "VLLM_RPC_BASE_PATH": rpc,
        "TOKENIZERS_PARALLELISM": "false",
    })
    try:
        results = (lora_reference_outputs(spec) if "adapters" in spec
                   else reference_outputs(tp, spec["prompts"], spec["checkpoints"]))
    finally:
        shutil.rmtree(rpc, ignore_errors=True)
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:3])

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
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any


def reference_outputs(tp: int, prompts: list[str], checkpoints: list[str]) -> dict[str, Any]:
    from vllm import LLM

    from .conftest import close_llm, generate

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


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    tp = int(spec["tp"])
    rpc = tempfile.mkdtemp(prefix="vrpc")  # unix socket paths must stay under 107 bytes
    os.environ.update({
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "0",
        "VLLM_RPC_BASE_PATH": rpc,
        "TOKENIZERS_PARALLELISM": "false",
    })
    try:
        results = reference_outputs(tp, spec["prompts"], spec["checkpoints"])
    finally:
        shutil.rmtree(rpc, ignore_errors=True)
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""The in-process engine run of tests/engine/test_inproc.py, in a process of its own.

``python -m tests.engine.inproc_follow TMP OUT``: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the
engine core and the worker live in the calling process, which they change for good: vLLM freezes
its environment variables there, binds the process's threads to the OMP cores, and walks every
loaded module while registering kernels (it trips over Flask's context proxies that moto's
server leaves in the test process). So the engine runs in a fresh process, as a user's would;
the test checks what it reports. OUT receives JSON: the rank's pid, the digests check per step,
outputs at step 0 and the last step (weight versions as strings), the engine core's status,
the last step's checkpoint, and the prefix-cache hits of each step's first serving and of the
last step's second (``num_cached_tokens``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

STEPS = 3
SEED = 41


def follow(tmp: Path) -> dict[str, Any]:
    from examples.toymodel import build_model
    from tests.helpers.engines import (
        Trainer,
        close_llm,
        engine_env,
        generate,
        long_prompts,
        make_llm,
        wait_applied,
    )
    from vllm_deltasync import DeltaPublisher
    from vllm_deltasync.server.worker.apply import sha256_hex

    model_dir = build_model(tmp / "model", family="llama", num_kv_heads=2, seed=SEED)
    trainer = Trainer(model_dir, lr=1e-5, seed=SEED)
    url = f"file://{tmp}/bucket"
    prompts = long_prompts(3, seed=SEED)
    out: dict[str, Any] = {"prompts": prompts, "digests_equal": {}, "process": os.getpid()}
    outputs: dict[int, list[dict[str, Any]]] = {}
    with DeltaPublisher(url, anchor_every=5) as pub, \
            engine_env(tmp, 1, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, url=url,
                       poll_interval_s=0.2, metrics_port=0):
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        llm = make_llm(model_dir, 1, extension=True)
        try:
            core = llm.llm_engine.engine_core.engine_core
            out["core_class"] = type(core).__name__
            statuses = wait_applied(llm, 0, timeout_s=90)
            out["rank_pid"] = statuses[0]["pid"]
            outputs[0] = generate(llm, prompts)  # fills the prefix cache with step-0 blocks
            for step in range(1, STEPS + 1):
                trainer.step()
                pub.publish(step, trainer.named_tensors())
                pub.flush()
                statuses = wait_applied(llm, step, timeout_s=90)
                out.setdefault("errors", []).append(statuses[0]["last_error"])
                live = llm.collective_rpc("deltasync_weight_digests")[0]
                want = {n: sha256_hex(t) for n, t in trainer.named_tensors()}
                out["digests_equal"][step] = live == want
                outputs[step] = generate(llm, prompts)
            out["cached"] = {s: [o["cached"] for o in outputs[s]] for s in outputs}
            out["cached_again"] = [o["cached"] for o in generate(llm, prompts)]
            status = core.deltasync_engine_status()
            out["ckpt"] = str(trainer.save(tmp / f"ckpt-{STEPS}"))
        finally:
            close_llm(llm)
    out["status"] = {"active": status["active"], "weight_version": status["weight_version"],
                     "switches": [s["step"] for s in status["switches"]]}
    out["outputs"] = {str(s): [{"tokens": o["tokens"], "prompt_logprobs": o["prompt_logprobs"],
                                "logprobs": o["logprobs"],
                                "versions": [v.version for v in o["weight_versions"] or ()]}
                               for o in outputs[s]] for s in (0, STEPS)}
    return out


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(follow(Path(sys.argv[1]))))

"""An in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) follows a bucket by itself.

vLLM then builds the ``EngineCore`` in the caller's process (``InprocClient``) and steps it from
the caller's thread: no busy loop, no input queue. The extension starts its coordinator once
the engine core is built and ticks before the client's steps and ``collective_rpc`` calls (at
most once per poll interval). The trainer publishes 3 real AdamW bf16 steps; after each the
live weights equal the trainer's bit for bit, and at the last step greedy tokens and prompt
logprobs equal a fresh stock engine's on that step's checkpoint (prompts the engine had served
at every earlier step, so stale prefix-cache blocks would show).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_model
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.server.extension import sha256_hex

from .conftest import (
    FreshOutputs,
    Trainer,
    close_llm,
    engine_env,
    generate,
    long_prompts,
    make_llm,
    requires_vllm,
    wait_applied,
)

STEPS = 3


@requires_vllm
@pytest.mark.engine
def test_inprocess_engine_follows_bucket(tmp_path: Path, fresh_outputs: FreshOutputs) -> None:
    seed = 41
    model_dir = build_model(tmp_path / "model", family="llama", num_kv_heads=2, seed=seed)
    trainer = Trainer(model_dir, lr=1e-5, seed=seed)
    url = f"file://{tmp_path}/bucket"
    prompts = long_prompts(3, seed=seed)
    outputs: dict[int, list[dict[str, Any]]] = {}
    with DeltaPublisher(url, anchor_every=5) as pub, \
            engine_env(tmp_path, 1, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, url=url,
                       poll_interval_s=0.2, metrics_port=0):
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        llm = make_llm(model_dir, 1, extension=True)
        try:
            core = llm.llm_engine.engine_core.engine_core
            assert type(core).__name__ == "EngineCore"  # in process: no busy loop
            statuses = wait_applied(llm, 0, timeout_s=90)
            assert statuses[0]["pid"] == os.getpid()
            outputs[0] = generate(llm, prompts)  # fills the prefix cache with step-0 blocks
            for step in range(1, STEPS + 1):
                trainer.step()
                pub.publish(step, trainer.named_tensors())
                pub.flush()
                statuses = wait_applied(llm, step, timeout_s=90)
                assert statuses[0]["last_error"] is None, statuses
                live = llm.collective_rpc("deltasync_weight_digests")[0]
                want = {n: sha256_hex(t) for n, t in trainer.named_tensors()}
                assert live == want, f"step {step}: live weights differ from the trainer's"
                outputs[step] = generate(llm, prompts)
            status = core.deltasync_engine_status()
            ckpt = trainer.save(tmp_path / f"ckpt-{STEPS}")
        finally:
            close_llm(llm)

    assert status["active"] and status["weight_version"] == str(STEPS)
    assert [s["step"] for s in status["switches"]] == list(range(STEPS + 1))
    assert all(o["weight_versions"][-1].version == str(STEPS) for o in outputs[STEPS])
    assert outputs[STEPS] != outputs[0]
    [reference] = fresh_outputs(1, prompts, [ckpt])
    for i, (got, ref) in enumerate(zip(outputs[STEPS], reference, strict=True)):
        assert got["tokens"] == ref["tokens"], f"prompt {i}: greedy tokens differ"
        assert got["prompt_logprobs"] == ref["prompt_logprobs"], f"prompt {i}: prompt logprobs differ"

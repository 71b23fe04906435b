"""The packed CPU mode (``cpu_kernels="packed"``, server/worker/packed.py) in a real engine.

The engine keeps vLLM's packed CPU GEMM kernels, the ones a stock engine uses, and packs again
the layers each switch wrote. Model: Qwen2-shaped (q/k/v biases) with tied embeddings, so the
packed lm_head computes from the embedding's parameter, written through another name; TP=2.

* every rank passes the startup proof in this mode (its write check packs the written layer
  again, so a write that never reached the packed copy would fail it) and reports its packed
  layers;
* after each step the live parameters equal the trainer's (digests), and each switch packed
  layers again; deltas staged while the engine held their base step switch on kernels packed
  ahead on the poller thread;
* a switch that fails on rank 1 after its first piece (failpoint) is taken back on both ranks:
  the weights (digests) and what the kernels compute (outputs equal those before it); the next
  anchor resyncs;
* at the first delta and the last step, greedy tokens and prompt logprobs equal a fresh stock
  engine's (same packed kernels) started from the trainer's checkpoint of that step: what the
  kernels compute is the step reported, not only what the parameters hold.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_model
from tests.helpers.engines import (
    FreshOutputs,
    Trainer,
    close_llm,
    digests_equal_checkpoint,
    engine_env,
    engine_status,
    generate,
    long_prompts,
    make_llm,
    open_bucket,
    requires_vllm,
    wait_applied,
)
from tests.helpers.hosts import NO_PACKING, vllm_packs_bf16_linears
from vllm_deltasync import DeltaPublisher, failpoints

STEPS = 5
FAIL_STEP = 3
"""Rank 1 fails this delta after its first piece; the anchor at 4 (anchor_every=4) resyncs."""


@requires_vllm
@pytest.mark.engine
def test_packed_kernels_follow_and_equal_a_stock_engine(
    request: pytest.FixtureRequest, tmp_path: Path, fresh_outputs: FreshOutputs,
) -> None:
    if not vllm_packs_bf16_linears():
        pytest.skip(NO_PACKING)
    tp = 2
    model_dir = build_model(tmp_path / "model", "qwen2", num_kv_heads=2, tie_word_embeddings=True,
                            seed=71)
    trainer = Trainer(model_dir, lr=1e-5, seed=71)
    bucket = open_bucket("file", request, tmp_path)
    prompts = long_prompts(3, seed=71)
    checkpoints: dict[int, Path] = {}
    outputs: dict[int, list[dict[str, Any]]] = {}
    extra = {**bucket.worker_env, **failpoints.env(failpoints.spec("apply", "policy", 1, FAIL_STEP, 1))}
    with DeltaPublisher(bucket.url, anchor_every=4) as pub, \
            engine_env(tmp_path, tp, extra, url=bucket.url, poll_interval_s=0.2,
                       metrics_port=0, cpu_kernels="packed"):

        def publish(step: int) -> None:
            trainer.step()
            pub.publish(step, trainer.named_tensors())
            pub.flush()
            checkpoints[step] = trainer.save(tmp_path / f"ckpt-{step}")

        pub.publish(0, trainer.named_tensors())
        pub.flush()
        llm = make_llm(model_dir, tp, extension=True)
        try:
            statuses = wait_applied(llm, 0, timeout_s=90)
            for s in statuses:
                assert s["refused"] is None, s["refused"]
                assert isinstance(s["cpu_kernels"], dict) and s["cpu_kernels"]["layers"] > 0, s
                assert s["proof"]["classes"], s["proof"]
            generate(llm, prompts)  # step-0 blocks in the prefix cache
            repacked = [s["cpu_kernels"]["repacked"] for s in statuses]
            for step in range(1, STEPS + 1):
                publish(step)
                if step == FAIL_STEP:
                    deadline = time.monotonic() + 60
                    while f"step {step}" not in (engine_status(llm)["last_error"] or ""):
                        assert time.monotonic() < deadline, engine_status(llm)
                        time.sleep(0.1)
                    status = engine_status(llm)
                    assert "failpoint" in status["last_error"], status["last_error"]
                    assert status["weight_version"] == str(step - 1)
                    assert digests_equal_checkpoint(llm, checkpoints[step - 1]), "not taken back"
                    # the kernels were packed again from the weights put back
                    again = generate(llm, prompts)
                    assert again == outputs[step - 1], "outputs after the taken-back switch differ"
                    continue
                statuses = wait_applied(llm, step, timeout_s=90)
                assert digests_equal_checkpoint(llm, checkpoints[step]), f"step {step}: live weights differ"
                now = [s["cpu_kernels"]["repacked"] for s in statuses]
                assert all(b > a for a, b in zip(repacked, now, strict=True)), (repacked, now)
                repacked = now
                outputs[step] = generate(llm, prompts)
            switches = engine_status(llm)["switches"]
            ahead = [s["cpu_kernels"]["prebuilt_used"] for s in llm.collective_rpc("deltasync_status")]
        finally:
            close_llm(llm)

    assert [s["step"] for s in switches] == [0, 1, 2, 4, 5], switches
    assert all(n >= 1 for n in ahead), ahead  # deltas switched on kernels packed ahead
    assert all(r > 0 for s in switches[1:] for r in s["repack_s"]), switches
    assert outputs[1] != outputs[STEPS]
    references = fresh_outputs(tp, prompts, [checkpoints[1], checkpoints[STEPS]])
    for step, want in zip((1, STEPS), references, strict=True):
        for i, (got, ref) in enumerate(zip(outputs[step], want, strict=True)):
            assert got["tokens"] == ref["tokens"], f"step {step} prompt {i}: tokens differ"
            assert got["prompt_logprobs"] == ref["prompt_logprobs"], (
                f"step {step} prompt {i}: prompt logprobs differ from a fresh stock engine's")

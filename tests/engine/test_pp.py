"""Pipeline parallel: each stage holds, fetches and writes only its own layers.

A Llama-shaped model (4 layers) at PP=2 follows a bucket on the local Hub server (hf://) for 3
steps. At every step both stages' live weights equal the trainer's (sha256 of the tensors each
stage holds; together they cover every checkpoint tensor). Each stage range-reads only the
chunks of its own tensors: the bytes each rank's store read stay well under the step, and
together the stages read each byte once (they share the node cache). At the last step greedy
tokens and prompt logprobs equal a fresh PP=2 engine started from that step's checkpoint.

The fresh engine also has the extension configured (its bucket is empty, so it follows
nothing): vLLM's CPU build fails the first generate at PP=2 in eager mode because it skips
allocating a later stage's input buffers (REFERENCE §3), and the extension allocates them at
start (``server/extension.py``, ``_pipeline_buffers``); a stock engine cannot serve here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_model
from tests.helpers.engines import (
    EXTENSION,
    Trainer,
    close_llm,
    engine_env,
    engine_status,
    generate,
    long_prompts,
    open_bucket,
    requires_vllm,
    wait_applied,
)
from vllm_deltasync import DeltaPublisher

STEPS = 3
SEED = 21


def _pp_llm(model_dir: Path) -> Any:
    from vllm import LLM

    return LLM(model=str(model_dir), pipeline_parallel_size=2, enforce_eager=True,
               max_model_len=1024, dtype="bfloat16", seed=0, enable_prefix_caching=True,
               max_num_seqs=8, worker_extension_cls=EXTENSION)


@requires_vllm
@pytest.mark.engine
def test_pipeline_stages_follow_their_own_layers(request: pytest.FixtureRequest,
                                                 tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "model", "llama", seed=SEED, num_layers=4)
    trainer = Trainer(model_dir, lr=1e-4, seed=SEED)
    bucket = open_bucket("hf", request, tmp_path)
    prompts = long_prompts(2, seed=SEED)
    with DeltaPublisher(bucket.url, anchor_every=10,
                        store_options=bucket.publisher_options) as pub, \
            engine_env(tmp_path, 2, bucket.worker_env, url=bucket.url, poll_interval_s=0.2,
                       metrics_port=0):
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        llm = _pp_llm(model_dir)
        try:
            statuses = wait_applied(llm, 0, timeout_s=120)
            assert all(not s["proof"]["failures"] for s in statuses), statuses
            generate(llm, prompts)
            for step in range(1, STEPS + 1):
                trainer.step()
                pub.publish(step, trainer.named_tensors())
                pub.flush()
                statuses = wait_applied(llm, step, timeout_s=120)
                assert all(s["last_error"] is None for s in statuses), statuses
                ckpt = trainer.save(tmp_path / f"ckpt-{step}")
                live = llm.collective_rpc("deltasync_weight_digests")
                want = llm.collective_rpc("deltasync_checkpoint_digests", args=(str(ckpt),))
                held = [set(g) for g in live]
                assert held[0] and held[1] and not held[0] & held[1], held  # disjoint stages
                assert held[0] | held[1] == {n for n, _ in trainer.named_tensors()}
                for rank, (got, exp) in enumerate(zip(live, want, strict=True)):
                    wrong = sorted(n for n in got if got[n] != exp[n])
                    assert not wrong, f"step {step} stage {rank}: differs in {wrong}"
            outputs = generate(llm, prompts)
            status = engine_status(llm)
            counters = [s["counters"] for s in llm.collective_rpc("deltasync_status")]
        finally:
            close_llm(llm)
    assert status["weight_version"] == str(STEPS)

    cdn = [r for r in bucket.server.requests("cdn") if r["status"] in (200, 206)]
    served = sum(r["bytes"] for r in cdn)
    distinct = sum({(r["path"], r["range"]): r["bytes"] for r in cdn}.values())
    assert served <= 1.15 * distinct, (served, distinct)  # the stages share the node cache
    per_rank = [c["store_bytes_read"] for c in counters]
    assert all(n > 0 for n in per_rank), per_rank
    assert max(per_rank) < 0.8 * served, (per_rank, served)  # nobody read the other's layers

    (tmp_path / "empty-bucket").mkdir()
    empty = f"file://{tmp_path}/empty-bucket"
    with engine_env(tmp_path, 2, url=empty, poll_interval_s=0.2, metrics_port=0):
        fresh = _pp_llm(tmp_path / f"ckpt-{STEPS}")
        try:
            want_outputs = generate(fresh, prompts)
        finally:
            close_llm(fresh)
    for i, (got, ref) in enumerate(zip(outputs, want_outputs, strict=True)):
        assert got["tokens"] == ref["tokens"], f"prompt {i}: greedy tokens differ"
        assert got["prompt_logprobs"] == ref["prompt_logprobs"], f"prompt {i}: logprobs differ"

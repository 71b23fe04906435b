"""A real vLLM engine follows a bucket that a real trainer publishes to, by itself.

For each model shape, tensor-parallel size and transport: the engine starts from the step-0
checkpoint with only ``worker_extension_cls`` and ``VLLM_DELTASYNC_*`` set (plus, for hf:// and
s3://, the standard variables that find the loopback server); the trainer publishes 11 real
AdamW bf16 steps (anchors at 5 and 10). After every step:

* each rank's live weights equal the trainer's bit for bit (sha256 per checkpoint tensor, per
  rank for its shard; at TP=1 also against the whole tensor's bytes, independent of the shard
  map);
* the engine serves the same prompts again (so every later step finds the earlier steps'
  blocks in the prefix cache).

At the reference steps (:data:`REFERENCE_STEPS`: the first delta, and the last step, the first
delta after an anchor) greedy tokens and prompt logprobs equal those of a fresh stock engine
of the same TP started from the trainer's checkpoint of that step (tests/engine/fresh_engine.py:
a new engine per checkpoint, no extension, so the CPU build prepacks its weights as for any
user). Stale prefix-cache blocks would show there: the prompts were served at every earlier
step. Bit-exact digests at every step plus fresh engines at chosen steps keep the module's
cost in fresh-engine starts at 2 per model and TP instead of 11 (the per-step comparison with a
fresh engine runs on a MoE model, tests/engine/test_moe.py).

Models, all built here: Llama-shaped with GQA (4 heads, 2 KV heads), Qwen2-shaped with q/k/v
biases, and Llama-shaped with tied embeddings and one KV head (replicated on both ranks at
TP=2). The vocabulary (500) is padded by vLLM, so rank 1's lm_head shard has padding rows.

At TP=2 over hf:// the ranks share the node cache (``stores/nodecache.py``): the local Hub
server served every byte range once (<= 1.15x the distinct bytes), and one rank ran discovery.

Every model runs at TP=1 and TP=2, once over hf:// (the local Hub bucket server) and once over
s3:// (moto), each transport at both TP sizes. file:// is the transport of every other engine
test; it ran here too, each (model, TP) a third time, until the suite needed the time (a
file:// run of this module cost ~80 s per case in CI, its (model, TP) pairs all covered here).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_model
from tests.helpers.engines import (
    FreshOutputs,
    Trainer,
    close_llm,
    engine_env,
    engine_status,
    generate,
    long_prompts,
    make_llm,
    open_bucket,
    requires_vllm,
    wait_applied,
)
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.server.worker.apply import sha256_hex

STEPS = 11  # published after the initial anchor; anchors at 5 and 10 (anchor_every=5)
REFERENCE_STEPS = (1, STEPS)
"""Steps compared with a fresh engine: the first delta, and the last (the first delta on top of
the anchor at 10). Step 6, the first delta on top of the anchor at 5, was compared too until the
suite needed the time: it checks what step 11 checks, and its digests are compared bit for bit
like every step's."""

MODELS: dict[str, dict[str, Any]] = {
    "llama-gqa": {"family": "llama", "num_kv_heads": 2},
    "qwen2-bias": {"family": "qwen2", "num_kv_heads": 2},
    "llama-tied": {"family": "llama", "num_kv_heads": 1, "tie_word_embeddings": True},
}

CASES = [
    pytest.param("hf", "llama-gqa", 2, id="hf-llama-gqa-tp2"),
    pytest.param("hf", "qwen2-bias", 1, id="hf-qwen2-bias-tp1"),
    pytest.param("hf", "llama-tied", 2, id="hf-llama-tied-tp2"),
    pytest.param("s3", "llama-gqa", 1, id="s3-llama-gqa-tp1"),
    pytest.param("s3", "qwen2-bias", 2, id="s3-qwen2-bias-tp2"),
    pytest.param("s3", "llama-tied", 1, id="s3-llama-tied-tp1"),
]


def _check_digests(llm: Any, trainer: Trainer, ckpt: Path, tp: int, step: int) -> None:
    live = llm.collective_rpc("deltasync_weight_digests")
    expected = llm.collective_rpc("deltasync_checkpoint_digests", args=(str(ckpt),))
    assert len(live) == tp
    for rank, (got, want) in enumerate(zip(live, expected, strict=True)):
        assert set(got) == set(want) and got, f"step {step} rank {rank}: digest names differ"
        wrong = sorted(n for n in got if got[n] != want[n])
        assert not wrong, f"step {step} rank {rank}: live weights differ from the trainer's in {wrong}"
    if tp == 1:  # independent of the shard map: the whole tensor's bytes
        for name, tensor in trainer.named_tensors():
            assert live[0][name] == sha256_hex(tensor), (step, name)


def _check_one_download_per_node(hub: Any, counters: list[dict[str, Any]]) -> None:
    """TP ranks share the node cache: every byte range the CDN served was asked for once
    (bytes served <= 1.15x the distinct bytes), and only one rank ran discovery."""
    served = [r for r in hub.requests("cdn") if r["status"] in (200, 206)]
    total = sum(r["bytes"] for r in served)
    distinct = {(r["path"], r["range"]): r["bytes"] for r in served}
    assert total <= 1.15 * sum(distinct.values()), (total, sum(distinct.values()))
    discovery = [sum(n for op, _, n in c["store_requests"] if op in ("list", "stat", "events"))
                 for c in counters]
    assert sum(1 for n in discovery if n > 0) == 1, discovery


@requires_vllm
@pytest.mark.engine
@pytest.mark.parametrize(("transport", "model", "tp"), CASES)
def test_engine_follows_bucket(
    request: pytest.FixtureRequest, tmp_path: Path, fresh_outputs: FreshOutputs,
    transport: str, model: str, tp: int,
) -> None:
    seed = 10 * list(MODELS).index(model) + tp  # the same trainer run on every transport
    model_dir = build_model(tmp_path / "model", seed=seed, **MODELS[model])
    trainer = Trainer(model_dir, lr=1e-5, seed=seed)
    bucket = open_bucket(transport, request, tmp_path)
    prompts = long_prompts(3, seed=seed)
    checkpoints: dict[int, Path] = {}
    per_step: dict[int, list[dict[str, Any]]] = {}
    with DeltaPublisher(bucket.url, anchor_every=5, store_options=bucket.publisher_options) as pub, \
            engine_env(tmp_path, tp, bucket.worker_env, url=bucket.url, poll_interval_s=0.2,
                       metrics_port=0):
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        llm = make_llm(model_dir, tp, extension=True)
        try:
            statuses = wait_applied(llm, 0, timeout_s=90)
            assert all(s["pid"] != os.getpid() for s in statuses)  # read in the workers
            before = generate(llm, prompts)  # fills the prefix cache with step-0 blocks
            for step in range(1, STEPS + 1):
                trainer.step()
                pub.publish(step, trainer.named_tensors())
                pub.flush()
                statuses = wait_applied(llm, step, timeout_s=90)
                assert all(s["last_error"] is None for s in statuses), statuses
                checkpoints[step] = trainer.save(tmp_path / f"ckpt-{step}")
                _check_digests(llm, trainer, checkpoints[step], tp, step)
                per_step[step] = generate(llm, prompts)  # also served before the next switch
            status = engine_status(llm)
            counters = [s["counters"] for s in llm.collective_rpc("deltasync_status")]
        finally:
            close_llm(llm)

    assert status["weight_version"] == str(STEPS)
    switched = [s["step"] for s in status["switches"]]
    assert switched[-1] == STEPS and set(switched) <= set(range(STEPS + 1))
    assert all(o["weight_versions"][-1].version == str(STEPS) for o in per_step[STEPS])
    assert [o["prompt_logprobs"] for o in per_step[STEPS]] != [o["prompt_logprobs"] for o in before]
    if bucket.server is not None:  # the workers downloaded from the CDN origin, tokenless
        assert bucket.server.cdn_bytes_served > 0
        assert bucket.server.cdn_auth_seen == 0
        if tp > 1:
            _check_one_download_per_node(bucket.server, counters)

    references = fresh_outputs(tp, prompts, [checkpoints[s] for s in REFERENCE_STEPS])
    for step, want in zip(REFERENCE_STEPS, references, strict=True):
        for i, (got, ref) in enumerate(zip(per_step[step], want, strict=True)):
            assert got["tokens"] == ref["tokens"], f"step {step} prompt {i}: greedy tokens differ"
            assert got["prompt_logprobs"] == ref["prompt_logprobs"], (
                f"step {step} prompt {i}: prompt logprobs differ from a fresh engine's"
            )

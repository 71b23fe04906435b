"""A vLLM engine follows a bucket that a sharded (FSDP2) trainer published, without gathering.

Two ``torchrun`` ranks train the engine's own checkpoint (a locally built Llama; vocab 301 is
an uneven dim-0 shard) with ``fully_shard`` and AdamW, and every rank publishes only its shards
(tests/helpers/dist_worker.py, scenario ``fsdp``: 3 steps, then a restart under a new run id
for 3 more, whose first step is an anchor). The engine, started from the checkpoint, reaches
the last step across the run change; its live weights equal the model gathered in the test,
and its outputs equal a fresh engine started from that gathered checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from examples.toymodel import build_model
from tests.helpers.engines import (
    FreshOutputs,
    close_llm,
    engine_env,
    engine_status,
    generate,
    long_prompts,
    make_llm,
    requires_vllm,
    wait_applied,
)
from tests.helpers.torchrun import torchrun

STEPS = 3  # per run: steps 0-2 (run a), 3-5 (run b, from an anchor)


@requires_vllm
@pytest.mark.engine
@pytest.mark.distributed
def test_engine_follows_a_sharded_trainer_to_its_last_step(
    tmp_path: Path, fresh_outputs: FreshOutputs
) -> None:
    model_dir = build_model(tmp_path / "model", "llama", hidden_size=64, num_layers=2,
                            num_heads=2, num_kv_heads=1, intermediate_size=96, vocab_size=301,
                            seed=7)
    url, out = f"file://{tmp_path}/bucket", tmp_path / "out"
    torchrun(2, "fsdp", url, str(out), "--steps", str(STEPS), "--init", str(model_dir))
    last = 2 * STEPS - 1

    ckpt = tmp_path / "ckpt-last"  # the gathered model (test side only), servable
    shutil.copytree(model_dir, ckpt, ignore=shutil.ignore_patterns("*.safetensors"))
    truth = load_file(str(out / f"truth-{last}.safetensors"))
    assert truth.keys() == load_file(str(model_dir / "model.safetensors")).keys()
    save_file(truth, str(ckpt / "model.safetensors"))

    prompts = long_prompts(2, seed=7)
    with engine_env(tmp_path, 1, url=url, poll_interval_s=0.2, metrics_port=0):
        llm = make_llm(model_dir, 1, extension=True)
        try:
            statuses = wait_applied(llm, last, timeout_s=120)
            assert all(s["last_error"] is None for s in statuses), statuses
            live = llm.collective_rpc("deltasync_weight_digests")
            want = llm.collective_rpc("deltasync_checkpoint_digests", args=(str(ckpt),))
            assert live == want and live[0], "live weights differ from the gathered model"
            got = generate(llm, prompts)
            status = engine_status(llm)
        finally:
            close_llm(llm)

    assert status["weight_version"] == str(last)
    assert all(o["weight_versions"][-1].version == str(last) for o in got)
    (reference,) = fresh_outputs(1, prompts, [ckpt])
    for i, (g, r) in enumerate(zip(got, reference, strict=True)):
        assert g["tokens"] == r["tokens"], f"prompt {i}: greedy tokens differ from a fresh engine"
        assert g["prompt_logprobs"] == r["prompt_logprobs"], f"prompt {i}: prompt logprobs differ"

"""A real vLLM engine follows a bucket that a real trainer publishes to, by itself.

For each model shape and tensor-parallel size: the engine starts from the step-0 checkpoint
with only ``worker_extension_cls`` and ``VLLM_DELTASYNC_*`` set; the trainer publishes 11
AdamW steps (anchors at 5 and 10). After every step each rank's live weights must equal the
trainer's bit for bit (sha256 per checkpoint tensor, per rank for its shard); after the last
step greedy tokens and prompt logprobs must equal a fresh engine of the same TP loaded from
the trainer's checkpoint of that step, for prompts the following engine had already served
(so stale prefix-cache blocks would show).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_deltasync import DeltaPublisher
from vllm_deltasync.extension import sha256_hex
from vllm_deltasync.toymodel import build_model

from .conftest import (
    Trainer,
    close_llm,
    engine_env,
    engine_status,
    generate,
    long_prompts,
    make_llm,
    requires_vllm,
    wait_applied,
)

STEPS = 11  # published after the initial anchor; anchors at 5 and 10 (anchor_every=5)

CASES = [
    pytest.param("llama", False, 1, id="llama-gqa-tp1"),
    pytest.param("llama", False, 2, id="llama-gqa-tp2"),
    pytest.param("qwen2", True, 1, id="qwen2-bias-tied-tp1"),
    pytest.param("qwen2", True, 2, id="qwen2-bias-tied-tp2"),
]


def _check_digests(llm, trainer: Trainer, ckpt: Path, tp: int, step: int) -> None:
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


@requires_vllm
@pytest.mark.engine
@pytest.mark.parametrize(("family", "tied", "tp"), CASES)
def test_engine_follows_bucket_bit_exact(tmp_path: Path, family: str, tied: bool, tp: int) -> None:
    model_dir = build_model(tmp_path / "model", family, tie_word_embeddings=tied, seed=tp)
    trainer = Trainer(model_dir, lr=1e-5, seed=tp)
    url = f"file://{tmp_path}/bucket"
    prompts = long_prompts(3, seed=tp)
    with DeltaPublisher(url, anchor_every=5) as pub, engine_env(
        tmp_path, tp, url=url, poll_interval_s=0.2, metrics_port=0
    ):
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        llm = make_llm(model_dir, tp, extension=True)
        try:
            wait_applied(llm, 0)
            before = generate(llm, prompts)  # fills the prefix cache with step-0 blocks
            for step in range(1, STEPS + 1):
                trainer.step()
                pub.publish(step, trainer.named_tensors())
                pub.flush()
                statuses = wait_applied(llm, step)
                assert all(s["last_error"] is None for s in statuses), statuses
                _check_digests(llm, trainer, trainer.save(tmp_path / f"ckpt-{step}"), tp, step)
                if step == 6:
                    generate(llm, prompts)  # served mid-way too
            after = generate(llm, prompts)
            status = engine_status(llm)
        finally:
            close_llm(llm)
    assert status["weight_version"] == str(STEPS)
    switched = [s["step"] for s in status["switches"]]
    assert switched[-1] == STEPS and set(switched) <= set(range(STEPS + 1))
    assert all(o["weight_versions"][-1].version == str(STEPS) for o in after)
    assert [o["prompt_logprobs"] for o in after] != [o["prompt_logprobs"] for o in before]

    with engine_env(tmp_path / "fresh", tp):
        fresh = make_llm(tmp_path / f"ckpt-{STEPS}", tp, extension=False)
        try:
            reference = generate(fresh, prompts)
        finally:
            close_llm(fresh)
    for got, want in zip(after, reference, strict=True):
        assert got["tokens"] == want["tokens"]
        assert got["prompt_logprobs"] == want["prompt_logprobs"]

"""MoE models on the CPU engine: learned runtime layouts, the startup proof, refusal.

vLLM's CPU MoE kernel pads the per-rank expert intermediate size to a multiple of 32 and
repacks ``w13_weight`` / ``w2_weight`` after loading (REFERENCE §3). Writes in checkpoint
layout land in the wrong places while digests read back through the same map agree; the only
evidence that counts is the engine answering like a fresh engine started from that step's
checkpoint. Here:

* Qwen3-MoE with a padded intermediate size (80 per expert -> 96 at TP=1) follows 3 steps;
  after each step greedy tokens and prompt logprobs equal a fresh engine's on that step's
  checkpoint, for prompts also served before the switch (prefix cache).
* Qwen3-MoE at TP=2 (40 per rank -> padded to 64) and Mixtral at TP=1 follow 3 steps and
  then answer like a fresh engine on the final weights.
* With the old checkpoint-layout path forced (``DELTASYNC_TEST_NO_LAYOUTS=1``), the startup
  proof refuses: no rank follows, the engine serves its checkpoint, ``/synced`` answers 503
  and ``deltasync_failing`` is 1 with the parameter named.

The fresh reference engines (tests/engine/fresh_engine.py) are stock engines; MoE kernels are
the same with or without the extension, and the extension's CPU GEMM patch gives the same
outputs as the prepacked linear kernels (tests/engine/test_follow.py).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_model
from vllm_deltasync import DeltaPublisher

from .conftest import (
    FreshOutputs,
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

STEPS = 3

MODELS: dict[str, dict[str, Any]] = {
    "qwen3-moe-padded": {"family": "qwen3_moe", "moe_intermediate_size": 80},
    "mixtral": {"family": "mixtral", "moe_intermediate_size": 64},
}


def _checkpoint_tensors(ckpt: Path) -> list[tuple[str, Any]]:
    """The tensors as the checkpoint names them (transformers fuses experts in memory and
    splits them per expert on save; the bucket follows the checkpoint's names)."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return sorted(tensors.items())


def _follow(tmp_path: Path, model: str, tp: int, *, per_step: bool,
            fresh_outputs: FreshOutputs) -> None:
    seed = 7 + tp
    model_dir = build_model(tmp_path / "model", seed=seed, **MODELS[model])
    trainer = Trainer(model_dir, lr=1e-4, seed=seed)
    url = f"file://{tmp_path}/bucket"
    prompts = long_prompts(2, seed=seed)
    outputs: dict[int, list[dict[str, Any]]] = {}
    checkpoints: dict[int, Path] = {}
    with DeltaPublisher(url, anchor_every=5) as pub, \
            engine_env(tmp_path, tp, url=url, poll_interval_s=0.2, metrics_port=0):
        pub.publish(0, _checkpoint_tensors(model_dir))
        pub.flush()
        llm = make_llm(model_dir, tp, extension=True)
        try:
            statuses = wait_applied(llm, 0, timeout_s=120)
            proof = statuses[0]["proof"]
            assert proof and not proof["failures"], proof
            experts = [c for c in proof["classes"] if c.endswith("w13_weight")]
            assert experts and "period" in proof["classes"][experts[0]]["layout"], proof
            assert proof["classes"][experts[0]]["write_check"] == "changed outputs"
            generate(llm, prompts)  # step-0 blocks in the prefix cache
            for step in range(1, STEPS + 1):
                trainer.step()
                checkpoints[step] = trainer.save(tmp_path / f"ckpt-{step}")
                pub.publish(step, _checkpoint_tensors(checkpoints[step]))
                pub.flush()
                statuses = wait_applied(llm, step, timeout_s=90)
                assert all(s["last_error"] is None for s in statuses), statuses
                outputs[step] = generate(llm, prompts)
            status = engine_status(llm)
        finally:
            close_llm(llm)
    assert status["weight_version"] == str(STEPS)
    steps = list(range(1, STEPS + 1)) if per_step else [STEPS]
    references = fresh_outputs(tp, prompts, [checkpoints[s] for s in steps])
    for step, want in zip(steps, references, strict=True):
        for i, (got, ref) in enumerate(zip(outputs[step], want, strict=True)):
            assert got["tokens"] == ref["tokens"], f"{model} step {step} prompt {i}: tokens"
            assert got["prompt_logprobs"] == ref["prompt_logprobs"], (
                f"{model} step {step} prompt {i}: prompt logprobs differ from a fresh engine's")


@requires_vllm
@pytest.mark.engine
def test_qwen3_moe_padded_each_step_like_fresh(tmp_path: Path,
                                               fresh_outputs: FreshOutputs) -> None:
    _follow(tmp_path, "qwen3-moe-padded", 1, per_step=True, fresh_outputs=fresh_outputs)


@requires_vllm
@pytest.mark.engine
def test_qwen3_moe_tp2_like_fresh(tmp_path: Path, fresh_outputs: FreshOutputs) -> None:
    _follow(tmp_path, "qwen3-moe-padded", 2, per_step=False, fresh_outputs=fresh_outputs)


@requires_vllm
@pytest.mark.engine
def test_mixtral_like_fresh(tmp_path: Path, fresh_outputs: FreshOutputs) -> None:
    _follow(tmp_path, "mixtral", 1, per_step=False, fresh_outputs=fresh_outputs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@requires_vllm
@pytest.mark.engine
def test_proof_refuses_checkpoint_layout_on_repacked_experts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = build_model(tmp_path / "model", family="mixtral", seed=3)
    url = f"file://{tmp_path}/bucket"
    port = _free_port()
    monkeypatch.setenv("DELTASYNC_TEST_NO_LAYOUTS", "1")
    prompts = long_prompts(1, seed=3)
    with DeltaPublisher(url, anchor_every=5) as pub, \
            engine_env(tmp_path, 2, url=url, poll_interval_s=0.2, metrics_port=port):
        pub.publish(0, _checkpoint_tensors(model_dir))
        pub.flush()
        llm = make_llm(model_dir, 2, extension=True)
        try:
            before = generate(llm, prompts)
            statuses = llm.collective_rpc("deltasync_status")
            status = engine_status(llm)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/synced", timeout=5)
            synced = json.loads(err.value.read())
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                metrics = r.read().decode()
            after = generate(llm, prompts)
        finally:
            close_llm(llm)
    assert err.value.code == 503
    assert all(s["refused"] and not s["following"] for s in statuses), statuses
    assert all(s["applied_step"] is None and s["ready_steps"] == [] for s in statuses)
    assert "w13_weight" in statuses[0]["refused"] or "w2_weight" in statuses[0]["refused"]
    assert not status["active"] and "startup proof failed" in status["last_error"]
    assert synced["coordinator"]["failing"] and "w13_weight" in str(synced)
    assert 'deltasync_failing{rank="0"} 1.0' in metrics
    assert 'deltasync_failing{rank="1"} 1.0' in metrics
    assert before == after  # still serving the checkpoint

"""A real vLLM engine follows a bucket that a real trainer publishes to, by itself.

For each model shape and tensor-parallel size: the engine starts from the step-0 checkpoint
with only ``worker_extension_cls`` and ``VLLM_DELTASYNC_*`` set; the trainer publishes 11
AdamW steps (anchors at 5 and 10). After every step each rank's live weights must equal the
trainer's bit for bit (sha256 per checkpoint tensor, per rank for its shard), and greedy
tokens and prompt logprobs must equal those of a reference engine holding the trainer's
checkpoint of that step, for prompts the following engine had already served before the
switch (so stale prefix-cache blocks would show):

* the last step against a fresh stock engine of the same TP (prepacked CPU kernels, no
  extension) started from that step's checkpoint;
* every earlier step against one more engine of the same TP that loads each step's checkpoint
  through vLLM's own ``reload_weights`` and starts from an empty prefix cache (restarting an
  engine per step would cost ~30 s each on this machine).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    per_step: dict[int, list[dict[str, Any]]] = {}
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
                per_step[step] = generate(llm, prompts)  # also served before the next switch
            after = per_step[STEPS]
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
    _assert_same_outputs(after, reference, STEPS)
    _compare_with_reloaded_engine(tmp_path, model_dir, tp, prompts, per_step)


def _assert_same_outputs(got: list[dict[str, Any]], want: list[dict[str, Any]], step: int) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["tokens"] == w["tokens"], f"step {step} prompt {i}: greedy tokens differ"
        assert g["prompt_logprobs"] == w["prompt_logprobs"], f"step {step} prompt {i}: logprobs differ"


def _reload_checkpoint(worker: Any, path: str) -> None:
    """Runs in each worker (sent with cloudpickle): vLLM's own full reload of a checkpoint."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    weights = load_file(path)
    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.reload_weights(
            weights_iterator=iter(weights.items()), is_checkpoint_format=True
        )


def _compare_with_reloaded_engine(
    tmp_path: Path, model_dir: Path, tp: int, prompts: list[str],
    per_step: dict[int, list[dict[str, Any]]],
) -> None:
    """Steps 1..STEPS-1: the following engine's outputs equal an engine that loaded that
    step's checkpoint with vLLM's own loader and has an empty prefix cache."""
    empty = f"file://{tmp_path}/empty-bucket"  # the extension keeps its CPU path but follows nothing
    with engine_env(tmp_path / "reload", tp, url=empty, metrics_port=0), _insecure_rpc():
        ref = make_llm(model_dir, tp, extension=True)
        try:
            for step in range(1, STEPS):
                ckpt = tmp_path / f"ckpt-{step}"
                ref.collective_rpc(_reload_checkpoint, args=(str(ckpt / "model.safetensors"),))
                live = ref.collective_rpc("deltasync_weight_digests")
                want = ref.collective_rpc("deltasync_checkpoint_digests", args=(str(ckpt),))
                assert live == want, f"step {step}: vLLM's reload did not load the checkpoint"
                assert ref.reset_prefix_cache() is not False
                _assert_same_outputs(per_step[step], generate(ref, prompts), step)
        finally:
            close_llm(ref)


@contextlib.contextmanager
def _insecure_rpc() -> Iterator[None]:
    """Let ``collective_rpc`` ship a test function to the workers (cloudpickle)."""
    saved = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
        else:
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = saved

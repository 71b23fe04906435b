"""A real vLLM engine follows a bucket of merged LoRA weights that a real PEFT trainer publishes.

The trainer wraps a tiny Llama built here (``examples/toymodel.py``) with
``peft.get_peft_model`` (LoRA rank 8 on q/k/v/o and the MLP projections; the adapter in
float32, PEFT's default) and trains the adapter with AdamW (lr 1e-3, a few optimizer steps
on one fixed token batch per published step, enough to change the merged bf16 weights). It
publishes ``pub.publish(step, peft_model)`` with the publisher's default ``lora="merged"``:
step 0 (the anchor) before the engine starts, then :data:`STEPS` more. The engine, started
from the base checkpoint with only ``worker_extension_cls`` and ``VLLM_DELTASYNC_*`` set,
follows the bucket as it follows any policy: nothing LoRA-specific on the server side.

After every step, at TP=1 and TP=2:

* the reference checkpoint of that step is PEFT's own ``merge_and_unload()`` on a deep copy of
  the training model, saved as bf16 safetensors beside the base checkpoint's config and
  tokenizer (never read from the engine);
* every rank's live weights equal that checkpoint bit for bit (sha256 per tensor, per rank
  for its shard), and the merged weights changed since the previous step;
* the training model's parameters (base and adapter) are bit-equal before and after the
  publish, and no PEFT layer is left merged;
* greedy tokens and prompt logprobs equal those of a fresh stock engine of the same TP
  started from that checkpoint (``fresh_outputs``: tests/engine/fresh_engine.py runs one new
  engine per checkpoint, all of a case's checkpoints in one child process, so the case pays
  one child start-up and ``STEPS + 1`` engine builds, not ``STEPS + 1`` process start-ups:
  measured on 2 shared cores, ~35 s for the five TP=1 references, ~150 s for the five TP=2
  ones). The prompts are served at every step, so stale prefix-cache blocks would show.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.toymodel import build_model, load_hf_model
from tests.helpers.engines import (
    FreshOutputs,
    close_llm,
    digests_equal_checkpoint,
    engine_env,
    engine_status,
    generate,
    long_prompts,
    make_llm,
    requires_vllm,
    wait_applied,
)
from vllm_deltasync import DeltaPublisher

peft = pytest.importorskip("peft", reason="the LoRA tests need peft (the 'lora' extra)")

STEPS = 4
"""Steps published after the step-0 anchor (5 published steps in all), each compared with a
fresh engine."""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OPT_STEPS = 3
"""AdamW steps between two published steps."""


class LoraPolicy:
    """A PEFT LoRA model over a locally built bf16 checkpoint, trained with AdamW on one fixed
    token batch (the adapter only; the base stays frozen, as PEFT sets it)."""

    def __init__(self, model_dir: Path, *, seed: int) -> None:
        base = load_hf_model(model_dir)
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS,
                                 lora_dropout=0.0, task_type="CAUSAL_LM")
        torch.manual_seed(seed)  # lora_A's initialisation
        self.model = peft.get_peft_model(base, config)
        self.model.train()
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                     lr=1e-3, weight_decay=0.0)
        gen = torch.Generator().manual_seed(seed)
        vocab = int(self.model.config.vocab_size)
        self.batch = torch.randint(2, vocab, (4, 32), generator=gen)
        self.model_dir = model_dir

    def train(self, steps: int = OPT_STEPS) -> None:
        for _ in range(steps):
            self.model(input_ids=self.batch, labels=self.batch).loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def save_merged(self, out_dir: Path) -> Path:
        """PEFT's ``merge_and_unload()`` of a deep copy, as a servable checkpoint: bf16
        safetensors with the base checkpoint's config, generation config and tokenizer."""
        merged = copy.deepcopy(self.model).merge_and_unload()
        dtypes = {p.dtype for p in merged.parameters()}
        assert dtypes == {torch.bfloat16}, f"merged weights are {dtypes}, not bf16"
        merged.save_pretrained(out_dir, safe_serialization=True)
        for f in self.model_dir.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, out_dir / f.name)
        return out_dir


def _bits(t: torch.Tensor) -> torch.Tensor:
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(view)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Bit patterns of every parameter and buffer (base and adapter), by state-dict name."""
    return {n: _bits(t).clone() for n, t in model.state_dict(keep_vars=True).items()}


def _publish(pub: DeltaPublisher, step: int, policy: LoraPolicy) -> None:
    """Publish ``step`` from the PEFT model and check it left the model as it was."""
    before = _snapshot(policy.model)
    pub.publish(step, policy.model)
    pub.flush()
    after = _snapshot(policy.model)
    assert list(before) == list(after)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert not changed, f"step {step}: publishing changed the training model's {changed}"
    assert not any(m.merged for m in policy.model.modules()
                   if isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer))
    assert any("lora_A" in n for n in before) and any("base_layer" in n for n in before)


def _weights_changed(old: Path, new: Path) -> bool:
    from safetensors.torch import load_file

    a, b = load_file(old / "model.safetensors"), load_file(new / "model.safetensors")
    assert set(a) == set(b)
    return any(not torch.equal(_bits(a[n]), _bits(b[n])) for n in a)


@requires_vllm
@pytest.mark.engine
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_engine_follows_merged_lora_policy(
    tmp_path: Path, fresh_outputs: FreshOutputs, tp: int
) -> None:
    seed = 70 + tp
    model_dir = build_model(tmp_path / "model", "llama", num_kv_heads=2, seed=seed)
    policy = LoraPolicy(model_dir, seed=seed)
    url = f"file://{tmp_path}/bucket"
    prompts = long_prompts(3, seed=seed)
    checkpoints: dict[int, Path] = {}
    outputs: dict[int, list[dict[str, Any]]] = {}
    with DeltaPublisher(url) as pub, \
            engine_env(tmp_path, tp, url=url, poll_interval_s=0.2, metrics_port=0):
        assert pub.options.lora == "merged"  # the default: what a PEFT model publishes
        _publish(pub, 0, policy)
        llm = make_llm(model_dir, tp, extension=True)
        try:
            for step in range(STEPS + 1):
                if step:
                    policy.train()
                    _publish(pub, step, policy)
                statuses = wait_applied(llm, step, timeout_s=90)
                assert all(s["last_error"] is None for s in statuses), statuses
                checkpoints[step] = policy.save_merged(tmp_path / f"merged-{step}")
                if step:
                    assert _weights_changed(checkpoints[step - 1], checkpoints[step]), (
                        f"step {step}: the merged bf16 weights did not change")
                assert digests_equal_checkpoint(llm, checkpoints[step]), (
                    f"step {step}: live weights differ from merge_and_unload()'s")
                outputs[step] = generate(llm, prompts)
            status = engine_status(llm)
        finally:
            close_llm(llm)

    assert status["weight_version"] == str(STEPS)
    assert all(o["weight_versions"][-1].version == str(STEPS) for o in outputs[STEPS])
    assert [o["prompt_logprobs"] for o in outputs[STEPS]] != [
        o["prompt_logprobs"] for o in outputs[0]]
    references = fresh_outputs(tp, prompts, [checkpoints[s] for s in range(STEPS + 1)])
    for step, want in enumerate(references):
        for i, (got, ref) in enumerate(zip(outputs[step], want, strict=True)):
            assert got["tokens"] == ref["tokens"], f"step {step} prompt {i}: greedy tokens differ"
            assert got["prompt_logprobs"] == ref["prompt_logprobs"], (
                f"step {step} prompt {i}: prompt logprobs differ from a fresh engine's")

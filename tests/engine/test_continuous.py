"""Generation never stops while steps arrive, and no model step ever mixes versions.

A TP=2 engine generates batch after batch while a trainer publishes steps. Each rank records,
for every model step it runs, the applied version at the start and at the end of the step
(``deltasync_trace``). Ranks run the same sequence of model steps, so the records must agree
position by position across ranks, and start and end must be equal within each step.

Switches are placed deterministically, not by timing: with the test-only
failpoint ``switch_every_steps`` the coordinator starts a switch only from a tick the engine
runs after every few model steps, so each step staged before a batch is switched to inside that
batch. Every way of treating requests in flight runs: ``keep_kv`` (the default: running
requests go on with the new weights from the KV they computed, so some request spans two
versions and the switch recomputes nothing), ``continue`` (the same spans, every running
request's KV computed again on the new weights: the switch records say how many and how many
tokens) and ``drain`` (the switch waits until running requests finish and holds new ones, so no
request spans two and nothing is kept or recomputed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.toymodel import build_model
from tests.helpers.engine_hooks import switch_every_steps_env
from tests.helpers.engines import (
    Trainer,
    close_llm,
    engine_env,
    engine_status,
    make_llm,
    requires_vllm,
    wait_applied,
    wait_ready,
)
from vllm_deltasync import DeltaPublisher

STEPS = 4
EVERY = 6  # model steps between switch ticks: a batch of 24 tokens runs 24 model steps


@requires_vllm
@pytest.mark.engine
@pytest.mark.parametrize("in_flight", ["keep_kv", "continue", "drain"])
def test_no_model_step_mixes_versions_across_or_within_ranks(tmp_path: Path, in_flight: str) -> None:
    from vllm import SamplingParams

    tp = 2
    model_dir = build_model(tmp_path / "model", "llama", seed=5)
    trainer = Trainer(model_dir, lr=1e-5, seed=5)
    url = f"file://{tmp_path}/bucket"
    params = SamplingParams(temperature=0.8, max_tokens=24, seed=1, ignore_eos=True)
    prompts = [f"rollout {i} the policy reward" for i in range(6)]
    with DeltaPublisher(url, anchor_every=3) as pub, engine_env(
        tmp_path, tp, switch_every_steps_env(EVERY), url=url, poll_interval_s=0.05,
        metrics_port=0, in_flight=in_flight,
    ):
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        llm = make_llm(model_dir, tp, extension=True)
        try:
            outputs = []
            for step in range(STEPS + 1):
                if step:
                    trainer.step()
                    pub.publish(step, trainer.named_tensors())
                    pub.flush()
                wait_ready(llm, step)  # staged on every rank, not yet switched to
                outputs.extend(llm.generate(prompts, params, use_tqdm=False))
                wait_applied(llm, step)  # the switch happened inside that batch
            outputs.extend(llm.generate(prompts, params, use_tqdm=False))
            traces = llm.collective_rpc("deltasync_trace")
            switches = [r for r in engine_status(llm)["switches"] if r["step"] > 0]
        finally:
            close_llm(llm)

    first, second = traces
    assert len(first) == len(second) and len(first) > 20
    assert first == second, "ranks ran some model step on different versions"
    assert all(start == end for _, start, end, _ in first), "a version changed during a step"
    versions_with_tokens = [start for _, start, _, tokens in first if tokens > 0]
    assert versions_with_tokens == sorted(versions_with_tokens)  # never goes back
    assert sorted(set(versions_with_tokens)) == [-1, *range(STEPS + 1)], "a switch was missed"
    assert versions_with_tokens[-1] == STEPS
    crossed = [o for o in outputs if len({s.version for s in o.outputs[0].weight_versions}) > 1]
    assert [r["step"] for r in switches] == list(range(1, STEPS + 1))
    assert {r["in_flight"] for r in switches} == {in_flight}
    if in_flight == "drain":
        assert not crossed, "drain: a request ran on two versions"
        assert all(r["kept"] == r["recomputed"] == 0 for r in switches), switches
        return
    assert len(crossed) >= STEPS + 1, "a switch did not land inside the batch"  # each of them
    if in_flight == "keep_kv":
        assert all(r["kept"] == len(prompts) and r["recompute_tokens"] == 0 for r in switches)
    else:
        assert all(r["recomputed"] == len(prompts) and r["kept"] == 0
                   and r["recompute_tokens"] > 0 for r in switches), switches

"""A busy engine switches every step within the bound (issue 34, item 8: "the stall").

A TP=2 engine generates long batches, one after another, while a trainer publishes ten steps
0.3 s apart. The engine core ticks between model steps (its wake-ups wait in the input queue
behind nothing), each tick reads every rank's status, and a step that every rank has staged is
switched at the first tick that sees it (``SWITCH_BOUND_TICKS``). The test fails if any step
waited staged on every rank past that bound (the follower's ``max_wait_ticks``), or if the
engine has not reached the last step right after the last one.

The cause found for the intermittent stall of the last rounds: the coordinator switched only to
a step every rank had staged *with the same staged steps before it*. Ranks plan their chains by
themselves; one whose poller saw the bucket later (or reached a step through an anchor) staged
another list, no prefix was common, and nothing became switchable while the staging bound kept
both lists full: a stall until something reset them. The common step is now the newest one
every rank has staged on the same applied weights (``server/engine/ready.py``); the unit test
``test_ranks_that_planned_different_chains_still_switch_to_the_step_they_share`` covers it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from examples.toymodel import build_model
from tests.helpers.engines import (
    Trainer,
    close_llm,
    engine_env,
    engine_status,
    make_llm,
    requires_vllm,
    wait_applied,
)
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.server.engine.follower import SWITCH_BOUND_TICKS

STEPS = 10
APART_S = 0.3


@requires_vllm
@pytest.mark.engine
def test_a_busy_tp2_engine_switches_every_step_within_the_bound(tmp_path: Path) -> None:
    from vllm import SamplingParams

    tp = 2
    model_dir = build_model(tmp_path / "model", "llama", seed=9)
    trainer = Trainer(model_dir, lr=1e-5, seed=9)
    url = f"file://{tmp_path}/bucket"
    params = SamplingParams(temperature=0.8, max_tokens=384, seed=3, ignore_eos=True)
    prompts = [f"rollout {i} of a long trace" for i in range(8)]
    published: list[float] = []
    with DeltaPublisher(url, anchor_every=4) as pub, engine_env(
            tmp_path, tp, url=url, poll_interval_s=0.1, metrics_port=0):
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        llm = make_llm(model_dir, tp, extension=True)
        try:
            wait_applied(llm, 0)

            def publish() -> None:
                for step in range(1, STEPS + 1):
                    time.sleep(APART_S)
                    trainer.step()
                    pub.publish(step, trainer.named_tensors())
                    pub.flush()
                    published.append(time.monotonic())

            trainer_thread = threading.Thread(target=publish, daemon=True)
            trainer_thread.start()
            outputs = []
            while trainer_thread.is_alive():  # serve without pause until the last step is out
                outputs.extend(llm.generate(prompts, params, use_tqdm=False))
            trainer_thread.join()
            assert len(published) == STEPS, "the trainer did not publish every step"
            statuses = wait_applied(llm, STEPS, timeout_s=30)
            status = engine_status(llm)
        finally:
            close_llm(llm)

    assert all(s["applied_step"] == STEPS for s in statuses), statuses
    switched = [r["step"] for r in status["switches"]]
    assert switched == sorted(switched) and switched[-1] == STEPS, switched
    assert status["max_wait_ticks"] <= SWITCH_BOUND_TICKS, status
    # the batches really ran across the switches (the engine was busy while they happened)
    crossed = [o for o in outputs if len({s.version for s in o.outputs[0].weight_versions}) > 2]
    assert crossed, "no request ran across several switches: the engine was not busy"

"""A switch that fails on one rank is taken back on every rank, and the engine keeps serving.

TP=2 engine following a file:// bucket. The test-only failpoint (``apply``,
vllm_deltasync/rank.py) makes rank 1 raise half-way through writing step 3, after rank 0 wrote
all of it. Then:

* both ranks hold step 2 again, bit for bit (live digests equal the trainer's step-2
  checkpoint), and the engine's weight version stays "2";
* generation is not held: the engine answers at once, with the same tokens and prompt
  logprobs as before the failed switch (the prefix cache it kept is still valid);
* a delta chained on the failed step is never applied; the next anchor is, and deltas chain
  from it again.

Then the engine core itself fails a switch (``switch``: after every rank
applied step 7, before the prefix-cache reset), and the next ticks fail too. The switch is taken
back on every rank (digests equal step 6, weight version "6", outputs as before), the failures
are counted in ``deltasync_coordinator_failures_total``, ``/synced`` answers 503 naming the
coordinator while the ticks keep failing, and the engine recovers through the next anchor.

Then the apply broadcast itself fails (``apply_rpc``: rank 1's
``deltasync_apply`` raises out of the RPC, before writing, while rank 0 wrote the step), twice:

* step 11: every rank is asked to revert; rank 0 puts its write back, rank 1 never wrote and
  keeps step 10. Both hold step 10 bit for bit, the label stays "10", outputs are unchanged,
  nothing is held, and the engine goes on through the next anchor (15);
* step 16, rank 1 "dirty" (as if it failed mid-write without putting back): its revert answers
  False, so the engine holds (label "inconsistent", ``/synced`` 503 naming the step), every rank
  forgets its step and resyncs through an anchor newer than the failed step (20), and
  scheduling resumes once both ranks applied it. The outputs then equal a fresh stock engine's
  on the step the server reports, and every output's weight version is that step.
"""

from __future__ import annotations

import json
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
    get_text,
    long_prompts,
    make_llm,
    requires_vllm,
    wait_applied,
)
from tests.helpers.net import free_port
from vllm_deltasync import DeltaPublisher, failpoints


def _wait_synced(base: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """``/synced`` once it answers 200 (metrics follow at the engine core's next tick)."""
    deadline = time.monotonic() + timeout_s
    while (answer := get_text(f"{base}/synced"))[0] != 200:
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)
    return dict(json.loads(answer[1]))


@requires_vllm
@pytest.mark.engine
def test_failed_switch_is_taken_back_and_the_engine_keeps_serving(
    tmp_path: Path, fresh_outputs: FreshOutputs,
) -> None:
    tp = 2
    model_dir = build_model(tmp_path / "model", "llama", seed=21)
    trainer = Trainer(model_dir, lr=1e-5, seed=21)
    url = f"file://{tmp_path}/bucket"
    prompts = long_prompts(2, seed=21)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with DeltaPublisher(url, anchor_every=5) as pub, engine_env(
        tmp_path, tp, failpoints.env(
            failpoints.spec("apply", "policy", 1, 3, 2), failpoints.spec("switch", "policy", 7, 10),
            failpoints.spec("apply_rpc", "policy", 1, 11),
            failpoints.spec("apply_rpc", "policy", 1, 16, "dirty")), url=url,
        poll_interval_s=0.2, metrics_port=port, metrics_host="127.0.0.1",
    ):

        def publish(step: int) -> None:
            trainer.step()
            pub.publish(step, trainer.named_tensors())
            pub.flush()

        pub.publish(0, trainer.named_tensors())
        pub.flush()
        llm = make_llm(model_dir, tp, extension=True)
        try:
            wait_applied(llm, 0)
            for step in (1, 2):
                publish(step)
                wait_applied(llm, step)
            ckpt2 = trainer.save(tmp_path / "ckpt-2")
            before = generate(llm, prompts)

            publish(3)  # rank 1 fails it half-way
            deadline = time.monotonic() + 60
            while "step 3" not in (engine_status(llm)["last_error"] or ""):
                assert time.monotonic() < deadline, engine_status(llm)
                time.sleep(0.1)
            status = engine_status(llm)
            assert "failpoint" in status["last_error"] and status["weight_version"] == "2"
            assert [r["applied_step"] for r in status["ranks"]] == [2, 2]
            assert digests_equal_checkpoint(llm, ckpt2), "the failed switch was not taken back"
            started = time.monotonic()
            again = generate(llm, prompts)
            assert time.monotonic() - started < 30, "generation was held after the failure"
            assert [o["tokens"] for o in again] == [o["tokens"] for o in before]
            assert [o["prompt_logprobs"] for o in again] == [o["prompt_logprobs"] for o in before]
            assert all(o["weight_versions"][-1].version == "2" for o in again)

            publish(4)  # a delta on the failed step: waits for an anchor
            time.sleep(2.0)
            assert [s["applied_step"] for s in llm.collective_rpc("deltasync_status")] == [2, 2]
            publish(5)  # the anchor
            wait_applied(llm, 5)
            assert digests_equal_checkpoint(llm, trainer.save(tmp_path / "ckpt-5"))
            publish(6)  # deltas chain from the anchor again
            statuses = wait_applied(llm, 6)
            assert all(s["last_error"] is None for s in statuses), statuses
            ckpt6 = trainer.save(tmp_path / "ckpt-6")
            assert digests_equal_checkpoint(llm, ckpt6)
            before = generate(llm, prompts)
            _wait_synced(base)

            publish(7)  # the engine core fails it after both ranks applied it
            deadline, seen_failing = time.monotonic() + 60, False
            while not seen_failing:
                assert time.monotonic() < deadline, engine_status(llm)
                code, body = get_text(f"{base}/synced")
                seen_failing = code == 503 and json.loads(body)["coordinator"]["failing"]
                time.sleep(0.05)
            assert "failpoint switch" in json.loads(body)["coordinator"]["last_error"]
            status = engine_status(llm)
            assert status["weight_version"] == "6", status
            assert [r["applied_step"] for r in status["ranks"]] == [6, 6], status
            assert digests_equal_checkpoint(llm, ckpt6), "the switch was not taken back"
            metrics = get_text(f"{base}/metrics")[1]
            failures = [line for line in metrics.splitlines()
                        if line.startswith("deltasync_coordinator_failures_total ")]
            assert failures and float(failures[0].split()[-1]) >= 3, failures
            again = generate(llm, prompts)
            assert [o["tokens"] for o in again] == [o["tokens"] for o in before]
            assert [o["prompt_logprobs"] for o in again] == [o["prompt_logprobs"] for o in before]
            assert all(o["weight_versions"][-1].version == "6" for o in again)
            for step in (8, 9, 10):  # 8, 9 chain through the failed 7; 10 is the anchor
                publish(step)
            wait_applied(llm, 10)
            assert digests_equal_checkpoint(llm, trainer.save(tmp_path / "ckpt-10"))
            assert not _wait_synced(base)["coordinator"]["failing"]
            ckpt10 = trainer.save(tmp_path / "ckpt-10")
            before = generate(llm, prompts)

            publish(11)  # the apply broadcast itself raises: rank 1's RPC, after rank 0 wrote
            deadline = time.monotonic() + 60
            while "step 11" not in (engine_status(llm)["last_error"] or ""):
                assert time.monotonic() < deadline, engine_status(llm)
                time.sleep(0.1)
            status = engine_status(llm)
            assert "apply broadcast failed" in status["last_error"], status
            assert "failpoint apply_rpc" in status["last_error"], status
            assert status["weight_version"] == "10" and status["held"] is None, status
            assert [r["applied_step"] for r in status["ranks"]] == [10, 10], status
            assert digests_equal_checkpoint(llm, ckpt10), "rank 0's write was not taken back"
            again = generate(llm, prompts)
            assert [o["tokens"] for o in again] == [o["tokens"] for o in before]
            assert [o["prompt_logprobs"] for o in again] == [o["prompt_logprobs"] for o in before]
            assert all(o["weight_versions"][-1].version == "10" for o in again)
            for step in (12, 13, 14, 15):  # 12-14 chain through the failed 11; 15 the anchor
                publish(step)
            wait_applied(llm, 15)
            ckpt15 = trainer.save(tmp_path / "ckpt-15")
            assert digests_equal_checkpoint(llm, ckpt15)
            assert engine_status(llm)["holds"] == []

            publish(16)  # rank 1 fails the RPC "dirty": its revert answers False: hold
            deadline = time.monotonic() + 60
            while (status := engine_status(llm))["held"] is None:
                assert time.monotonic() < deadline, status
                time.sleep(0.1)
            assert "step 16" in status["held"] and "could not take it back" in status["held"]
            assert status["weight_version"] == "inconsistent", status
            time.sleep(1.0)  # the ranks reset; rank 0 dropped 16, so it waits for anchor 20
            status = engine_status(llm)
            assert status["held"] is not None and status["weight_version"] == "inconsistent"
            assert [r["applied_step"] for r in status["ranks"]] == [None, None], status
            code, body = get_text(f"{base}/synced")
            assert code == 503 and "SwitchHeld" in json.loads(body)["coordinator"]["last_error"]
            assert "step 16" in json.loads(body)["coordinator"]["last_error"], body
            for step in (17, 18, 19, 20):  # 20: the anchor both ranks can reach
                publish(step)
            wait_applied(llm, 20)
            deadline = time.monotonic() + 30
            while (status := engine_status(llm))["held"] is not None:
                assert time.monotonic() < deadline, status
                time.sleep(0.1)
            hold = status["holds"][-1]
            assert hold["released_step"] == 20, hold
            print(f"held {hold['released_at'] - hold['at']:.2f}s until anchor 20 applied")
            assert status["weight_version"] == "20", status
            ckpt20 = trainer.save(tmp_path / "ckpt-20")
            assert digests_equal_checkpoint(llm, ckpt20)
            started = time.monotonic()
            after_hold = generate(llm, prompts)
            assert time.monotonic() - started < 30, "generation still held after the release"
            assert all(o["weight_versions"][-1].version == "20" for o in after_hold)
            assert not _wait_synced(base)["coordinator"]["failing"]
            final = engine_status(llm)
        finally:
            close_llm(llm)
    switched = [s["step"] for s in final["switches"]]
    assert not {3, 4, 7, 8, 9, 11, 12, 13, 14, 16, 17, 18, 19} & set(switched), switched
    assert switched[-5:] == [5, 6, 10, 15, 20], switched
    assert final["weight_version"] == "20" and final["failed_ticks"] == 0
    (want,) = fresh_outputs(tp, prompts, [ckpt20])
    assert [o["tokens"] for o in after_hold] == [o["tokens"] for o in want]
    assert [o["prompt_logprobs"] for o in after_hold] == [o["prompt_logprobs"] for o in want]

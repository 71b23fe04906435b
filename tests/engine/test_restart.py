"""A trainer restarted from an older checkpoint (issue 23): a real engine follows it across.

One TP=1 engine follows a file:// bucket (poll every 0.2 s, metrics server on):

1. Run A publishes steps 0 (anchor), 1, 2, 3; the trainer's checkpoint of step 1 is kept. The
   engine applies step 3 and serves the prompts (its prefix cache holds step-3 blocks).
2. The documented restart (docs/format.md §10, docs/trainer.md "Restarting a trainer"): run B
   starts from step 1's checkpoint (another seed, so it diverges) with a new
   ``DeltaPublisher(url, resumed_from=1)``; nothing is removed from the bucket. It publishes at
   ``next_step``: 4 (an anchor recording ``resumed_from=1``) and 5 (a delta). The engine
   reaches step 5 through that anchor and reports the branch change (each rank's
   ``branch_changes`` counter, one log line naming the abandoned steps 2-3); its weights equal
   B's step 5 bit for bit and it generates what a fresh stock engine on B's step-5 checkpoint
   generates, every output labelled weight version "5".
3. The red team's case, on the same engine: run C restarts from B's checkpoint of step 4, the
   operator removes step 5 and C publishes 5 (an anchor, ``resumed_from=4``) and 6 (a delta on
   C's 5). The engine applied B's 5, so a delta 6 whose base is "step 5" must not be applied
   on it. So that the engine takes exactly that path (it never sees the bucket without a step
   5, only another step 5 and a delta chained on it, as a server polling every few seconds
   would), C publishes into a copy of the bucket without step 5 and the new files are then
   moved into the bucket, B's step-5 manifest replaced by C's in one rename. The engine reports
   the branch change ("holds another step 5"; counter, metric), applies C's anchor 5 and then
   6, and ends with weights equal to C's step 6 and the outputs of a fresh engine on C's
   step-6 checkpoint. No apply fails: a delta is never tried on the wrong base.
"""

from __future__ import annotations

import os
import shutil
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
from tests.helpers.follow import remove_steps
from tests.helpers.net import free_port
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.format.layout import manifest_path
from vllm_deltasync.format.manifest import load_document, manifest_identity

ANCHOR_EVERY = 1000
"""Every anchor here is a publisher's first step: a restart is what makes one."""


def _identity(root: Path, step: int) -> str:
    return manifest_identity((root / manifest_path(step)).read_bytes())


def _branch_changes(llm: Any) -> list[int]:
    return [s["counters"]["branch_changes"] for s in llm.collective_rpc("deltasync_status")]


def _move_in(staging: Path, root: Path, steps: list[int], scratch: Path) -> None:
    """Move steps published into ``staging`` into the bucket ``root``: data first (nothing names
    it yet), then each manifest by one rename each (replacing one of the same step number in
    place), in step order, so a reader never sees a step missing or a manifest half-written."""
    for step in steps:
        for folder in (staging / "data").glob(f"{step:012d}-*"):
            shutil.copytree(folder, root / "data" / folder.name)
    for step in steps:
        tmp = scratch / f"manifest-{step}.json"  # same file system as the bucket
        shutil.copyfile(staging / manifest_path(step), tmp)
        os.replace(tmp, root / manifest_path(step))


def _remove_steps_data(root: Path, step: int, *, keep: Path) -> None:
    """Remove the data folders of ``step`` that the bucket's manifest no longer names (the
    replaced step's), keeping those moved in from ``keep``."""
    new = {f.name for f in (keep / "data").glob(f"{step:012d}-*")}
    for folder in (root / "data").glob(f"{step:012d}-*"):
        if folder.name not in new:
            shutil.rmtree(folder)


def _same_outputs(got: list[dict[str, Any]], want: list[dict[str, Any]], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["tokens"] == w["tokens"], f"{what} prompt {i}: greedy tokens differ"
        assert g["prompt_logprobs"] == w["prompt_logprobs"], (
            f"{what} prompt {i}: prompt logprobs differ from a fresh engine's")


@requires_vllm
@pytest.mark.engine
def test_engine_follows_a_restarted_trainer_and_reports_the_branch_change(
    tmp_path: Path, fresh_outputs: FreshOutputs, capfd: pytest.CaptureFixture[str],
) -> None:
    tp = 1
    model_dir = build_model(tmp_path / "model", "llama", seed=31)
    url, root = f"file://{tmp_path}/bucket", tmp_path / "bucket"
    prompts = long_prompts(2, seed=31)
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    def publish(pub: DeltaPublisher, trainer: Trainer, step: int) -> None:
        trainer.step()
        pub.publish(step, trainer.named_tensors())
        pub.flush()

    # 1. run A: 0 (anchor), 1, 2, 3; its checkpoint of step 1 is kept
    run_a = Trainer(model_dir, lr=1e-4, seed=31)
    with DeltaPublisher(url, anchor_every=ANCHOR_EVERY) as pub:
        pub.publish(0, run_a.named_tensors())
        pub.flush()
        publish(pub, run_a, 1)
        ckpt_a1 = run_a.save(tmp_path / "ckpt-a1")
        publish(pub, run_a, 2)
        publish(pub, run_a, 3)
    ckpt_a3 = run_a.save(tmp_path / "ckpt-a3")

    with engine_env(tmp_path, tp, url=url, poll_interval_s=0.2, metrics_port=port,
                    metrics_host="127.0.0.1"):
        llm = make_llm(model_dir, tp, extension=True)
        try:
            wait_applied(llm, 3, timeout_s=90)
            assert digests_equal_checkpoint(llm, ckpt_a3)
            at_a3 = generate(llm, prompts)  # fills the prefix cache with step-3 blocks
            assert _branch_changes(llm) == [0]

            # 2. the documented restart: from step 1's checkpoint, nothing removed
            run_b = Trainer(ckpt_a1, lr=1e-4, seed=32)
            with DeltaPublisher(url, resumed_from=1, anchor_every=ANCHOR_EVERY) as pub:
                assert pub.next_step == 4
                publish(pub, run_b, 4)
                ckpt_b4 = run_b.save(tmp_path / "ckpt-b4")
                publish(pub, run_b, 5)
            ckpt_b5 = run_b.save(tmp_path / "ckpt-b5")
            doc = load_document((root / manifest_path(4)).read_bytes())
            assert doc["kind"] == "anchor" and doc["resumed_from"] == 1, doc
            assert (root / manifest_path(3)).exists()  # nothing was removed

            statuses = wait_applied(llm, 5, timeout_s=90)
            assert all(s["last_error"] is None for s in statuses), statuses
            assert all(s["branch_lost"] is None for s in statuses), statuses
            assert all(s["counters"]["branch_changes"] >= 1 for s in statuses), statuses
            assert all(s["applied_id"] == _identity(root, 5) for s in statuses), statuses
            assert digests_equal_checkpoint(llm, ckpt_b5), "live weights differ from B's step 5"
            at_b5 = generate(llm, prompts)
            assert all(o["weight_versions"][-1].version == "5" for o in at_b5)
            assert [o["prompt_logprobs"] for o in at_b5] != [o["prompt_logprobs"] for o in at_a3]
            status = engine_status(llm)
            assert status["weight_version"] == "5", status
            b_switches = [s for s in status["switches"] if s["step"] >= 4]
            assert b_switches[0]["kinds"][0] == "anchor" and b_switches[0]["steps"][0] == 4, (
                b_switches)  # onto run B through its anchor, never A's 3 + B's delta 5

            # 3. the red team's case: restart from B's step 4, step 5 removed and reused
            changes_before = _branch_changes(llm)
            applied_anchors = [s["counters"]["applied_steps"]["anchor"]
                               for s in llm.collective_rpc("deltasync_status")]
            old_five = _identity(root, 5)
            n_switches = len(status["switches"])
            staging = tmp_path / "staging"
            shutil.copytree(root, staging)
            remove_steps(staging, [5])
            run_c = Trainer(ckpt_b4, lr=1e-4, seed=33)
            with DeltaPublisher(f"file://{staging}", resumed_from=4,
                                anchor_every=ANCHOR_EVERY) as pub:
                assert pub.next_step == 5
                publish(pub, run_c, 5)
                publish(pub, run_c, 6)
            ckpt_c6 = run_c.save(tmp_path / "ckpt-c6")
            _move_in(staging, root, [5, 6], tmp_path)
            _remove_steps_data(root, 5, keep=staging)  # the operator's cleanup of B's data
            new_five, new_six = _identity(root, 5), _identity(root, 6)
            assert new_five != old_five
            assert load_document((root / manifest_path(5)).read_bytes())["kind"] == "anchor"

            statuses = wait_applied(llm, 6, timeout_s=90)
            assert all(s["last_error"] is None for s in statuses), statuses
            assert all(s["branch_lost"] is None for s in statuses), statuses
            assert all(s["applied_id"] == new_six for s in statuses), statuses
            changes_after = _branch_changes(llm)
            assert all(a > b for a, b in zip(changes_after, changes_before, strict=True)), (
                changes_before, changes_after)
            counters = [s["counters"] for s in statuses]
            assert [c["applied_steps"]["anchor"] for c in counters] == [
                n + 1 for n in applied_anchors], counters  # through C's anchor 5
            assert not [f for c in counters for f in c["failures"] if f[0] == "apply"], counters
            assert digests_equal_checkpoint(llm, ckpt_c6), "live weights differ from C's step 6"
            at_c6 = generate(llm, prompts)
            assert all(o["weight_versions"][-1].version == "6" for o in at_c6)
            status = engine_status(llm)
            assert status["weight_version"] == "6", status
            c_switches = status["switches"][n_switches:]
            applied = [(st, k) for s in c_switches
                       for st, k in zip(s["steps"], s["kinds"], strict=True)]
            assert applied == [(5, "anchor"), (6, "delta")], c_switches
            assert c_switches[-1]["identity"] == new_six, c_switches

            # what an operator sees: /synced is green again, the metric counted both changes
            deadline = time.monotonic() + 30
            while True:
                code, body = get_text(f"{base}/synced")
                metrics = get_text(f"{base}/metrics")[1]
                counted = [float(line.split()[-1]) for line in metrics.splitlines()
                           if line.startswith("deltasync_branch_changes_total{")]
                if code == 200 and counted and sum(counted) >= sum(changes_after):
                    break
                assert time.monotonic() < deadline, (code, body, counted)
                time.sleep(0.2)
        finally:
            close_llm(llm)

    log = capfd.readouterr()
    text = log.out + log.err
    print("\n".join(line for line in text.splitlines() if "branch changed" in line))
    restart_lines = text.count("restarted from its checkpoint of step 1 (anchor 4); steps 2-3")
    assert restart_lines == tp, f"the documented restart logged {restart_lines}x, not once a rank"
    replaced_lines = text.count("the bucket now holds another step 5")
    assert replaced_lines == tp, f"the replaced step 5 logged {replaced_lines}x, not once a rank"

    want_b5, want_c6 = fresh_outputs(tp, prompts, [ckpt_b5, ckpt_c6])
    _same_outputs(at_b5, want_b5, "run B step 5")
    _same_outputs(at_c6, want_c6, "run C step 6")


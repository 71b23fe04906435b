"""One owner for a rank's sync state, driven from the poller thread and the main thread at once.

A real ``TargetRank`` (vLLM's own Llama module, a real shard map, a real ``Poller`` following a
file:// bucket that a trainer thread keeps publishing to) is driven the way a worker is: the
poller thread discovers, downloads and stages on its own while the main thread applies,
commits, reverts and resets at random, and a third thread reads status all the time (as the
engine core and its metrics do). After every command the next status read must show its
effect; no thread may raise; at the end the live weights equal the trainer's last step.
"""

from __future__ import annotations

import importlib.util
import logging
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.tp_world import TPWorld, live_checkpoint, target_rank
from tests.helpers.waiting import wait_until
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.server.messages import CommitOutcome
from vllm_deltasync.server.worker.apply import checkpoint_digest, tensor_digest


def _train(state: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    for t in state.values():
        bits = t.view(torch.int16).reshape(-1)
        mask = torch.rand(bits.numel(), generator=gen) < 0.02
        bits[mask] += 1


def _wait(predicate: Any, timeout_s: float = 30.0) -> None:
    wait_until(predicate, timeout_s, "the rank's state", interval=0.005)


def test_commands_from_two_threads_are_each_visible_in_the_next_status(
    tp_world: TPWorld, tmp_path: Path
) -> None:
    ckpt, live, weights = live_checkpoint(tp_world, tmp_path, "llama_gqa", seed=11)

    url = f"file://{tmp_path}/bucket"
    rank = target_rank(live, ckpt, SyncConfig(url=url, poll_interval_s=0.01))
    history: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []
    stop_reading = threading.Event()
    trainer_gen, rng = torch.Generator().manual_seed(12), random.Random(13)
    phase_one = 16  # random reverts and resets only while these steps arrive

    with DeltaPublisher(url, anchor_every=4, keep_anchors=100) as pub:

        def publish(steps: range) -> None:
            for step in steps:
                _train(weights, trainer_gen)
                history[step] = {n: t.clone() for n, t in weights.items()}
                pub.publish(step, weights.items())
                pub.flush()
                time.sleep(0.01)

        def read_status() -> None:
            try:
                while not stop_reading.is_set():
                    s = rank.status()
                    assert list(s.ready_steps) == sorted(s.ready_steps)
                    rank.poller.ready_steps()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        trainer = threading.Thread(target=publish, args=(range(phase_one),))
        reader = threading.Thread(target=read_status)
        rank.poller.start()
        trainer.start()
        reader.start()
        counts = {"apply": 0, "commit": 0, "revert": 0, "reset": 0}
        try:
            while trainer.is_alive() or rank.sync.ready_steps():
                ready = rank.sync.ready_steps()
                if not ready:
                    time.sleep(0.002)
                    continue
                before = rank.status().applied_step
                step = rng.choice(ready)
                assert rank.switch.apply(step).ok
                counts["apply"] += 1
                s = rank.status()
                assert s.applied_step == step and s.pending_switch == step, s
                assert all(r > step for r in s.ready_steps), s
                assert s.last_apply.step == step and s.last_error is None, s
                choice = rng.random()
                if choice < 0.6:
                    assert rank.switch.commit(step).outcome is CommitOutcome.COMMITTED
                    counts["commit"] += 1
                    s = rank.status()
                    assert s.pending_switch is None and s.applied_step == step, s
                    twice = rank.switch.commit(step)
                    assert twice.outcome is CommitOutcome.NOT_PENDING, "committed twice"
                elif choice < 0.85:
                    back = rank.switch.revert(step, f"test revert of {step}")
                    counts["revert"] += 1
                    s = rank.status()
                    if back.outcome.as_before:  # back on the step before, waiting for a newer anchor
                        assert s.applied_step == before, (s, before)
                    else:  # an anchor was written: its undo is incomplete, resync
                        assert s.applied_step is None, s
                    assert s.pending_switch is None and s.ready_steps == (), s
                    assert s.last_error.startswith(f"test revert of {step}"), s
                else:
                    rank.switch.reset(f"test reset after {step}")
                    counts["reset"] += 1
                    s = rank.status()
                    assert s.applied_step is None and s.ready_steps == (), s
                    assert s.pending_switch is None and s.last_error == f"test reset after {step}"
                if before is not None and choice < 0.6:
                    assert rank.status().applied_step == step
            trainer.join()
            assert all(counts.values()), counts

            # then only applies and commits: the last steps (from an anchor) must all land
            last = phase_one + 2
            publish(range(phase_one, last + 1))  # phase_one is a multiple of anchor_every
            while rank.status().applied_step != last:
                _wait(lambda: bool(rank.sync.ready_steps()))
                step = rank.sync.ready_steps()[-1]
                assert rank.switch.apply(step).ok
                assert rank.switch.commit(step).outcome is CommitOutcome.COMMITTED
        finally:
            stop_reading.set()
            reader.join(timeout=10)
            rank.poller.close()

    assert not errors, errors
    status = rank.status()
    assert status.last_error is None, status
    assert [f for f in status.counters.failures if f[0] != "apply"] == [], status
    want = history[last]
    for name in rank.shardmap.names:
        if name in rank.shardmap.ignored or name in rank.shardmap.covered_by:
            continue
        assert tensor_digest(rank.shardmap, name) == checkpoint_digest(
            rank.shardmap, name, want[name]), name


def test_a_closed_poller_stays_closed(tmp_path: Path) -> None:
    """Its loop thread is not started again behind the owner's back."""
    from vllm_deltasync.server.worker.poller import Poller

    poller = Poller(SyncConfig(url=f"file://{tmp_path}/b", poll_interval_s=0.01),
                    lambda m, p: (p, 0))
    poller.start()
    poller.close()
    threads = {t.name for t in threading.enumerate()}
    poller.state.reset("after close")  # signals room: must not restart the loop
    assert poller.ready_steps() == [] and poller.status().last_error == "after close"
    assert {t.name for t in threading.enumerate()} <= threads
    assert not any(t.name == "deltasync-poller-rank0" for t in threading.enumerate())


def test_a_rank_closed_at_shutdown_stops_its_poller_and_reports_nothing(
    tp_world: TPWorld, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's shutdown closes the poller before vLLM tears the process down: the loop
    thread is gone and nothing is reported as a failure (it once logged "discover failed")."""
    ckpt, live, _ = live_checkpoint(tp_world, tmp_path, "llama_gqa", seed=11)
    rank = target_rank(live, ckpt, SyncConfig(url=f"file://{tmp_path}/bucket", poll_interval_s=0.01))
    rank.follow()
    _wait(lambda: rank.poller.status().last_discovery_at is not None)
    with caplog.at_level(logging.DEBUG, logger="vllm_deltasync"):
        rank.close()
        rank.close()  # a second shutdown finds nothing to do
    assert not rank.following
    assert not any(t.name == "deltasync-poller-rank0" for t in threading.enumerate())
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert rank.poller.status().last_error is None


@pytest.mark.parametrize("decoder", ["auto", "numpy"])
def test_following_readies_the_configured_decoder(
    decoder: str, tp_world: TPWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``decoder`` reaches the codecs before the poller starts: ``auto`` compiles sparse-v3's
    numba kernel (where numba is installed), ``numpy`` leaves it out; a step then stages."""
    from vllm_deltasync.format import sparse_v3

    monkeypatch.setattr(sparse_v3, "_KERNEL", [])  # undecided, as in a fresh worker
    ckpt, live, weights = live_checkpoint(tp_world, tmp_path, "llama_gqa", seed=12)
    url = f"file://{tmp_path}/bucket"
    state = {k: v.clone() for k, v in weights.items()}
    pub = DeltaPublisher(url, anchor_every=100)
    pub.publish(0, state)
    _train(state, torch.Generator().manual_seed(1))
    pub.publish(1, state)
    pub.close()
    rank = target_rank(live, ckpt, SyncConfig(url=url, poll_interval_s=0.01, decoder=decoder))
    rank.follow()
    try:
        assert len(sparse_v3._KERNEL) == 1
        numba_here = importlib.util.find_spec("numba") is not None
        assert (sparse_v3._KERNEL[0] is not None) == (decoder == "auto" and numba_here)
        _wait(lambda: 1 in rank.sync.ready_steps())
    finally:
        rank.close()

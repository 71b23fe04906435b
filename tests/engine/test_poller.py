"""The poller against a real file:// bucket written by the real publisher (no vLLM)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from vllm_deltasync import DeltaPublisher
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import DeltaSyncError
from vllm_deltasync.format.manifest import fingerprint
from vllm_deltasync.server.worker.poller import Poller


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": (torch.randn(64, 48, generator=g) * 0.02).bfloat16(),
            "b": (1 + 0.1 * torch.randn(96, generator=g)).bfloat16()}


def _step(w: dict[str, torch.Tensor], g: torch.Generator) -> None:
    for t in w.values():
        bits = t.view(torch.int16).reshape(-1)
        mask = torch.rand(bits.numel(), generator=g) < 0.05
        bits[mask] += 1


def _patches_bytes(manifest, patches):
    return patches, sum(p.values.numel() * p.values.element_size() for p in patches)


def _wait(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_poller_stages_chain_and_applier_reaches_every_step_bit_exact(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    trainer, g = _weights(0), torch.Generator().manual_seed(1)
    live = {k: torch.zeros_like(v) for k, v in trainer.items()}  # unknown start: needs an anchor
    cfg = SyncConfig(url=url, poll_interval_s=0.05)
    poller = Poller(cfg, _patches_bytes)
    poller.start()
    try:
        with DeltaPublisher(url, anchor_every=4) as pub:
            for step in range(10):
                _step(trainer, g)
                pub.publish(step, trainer.items())
                pub.flush()
                _wait(lambda s=step: s in poller.ready_steps())
                for staged in poller.state.take(step):
                    if staged.manifest.kind == "delta":
                        assert staged.manifest.base_step == poller.state.applied_step
                    for p in staged.payload:
                        p.apply_to(live[p.name].view(-1))
                    poller.state.mark_applied(staged.manifest)
                assert all(torch.equal(live[k], trainer[k]) for k in trainer), step
        status = poller.status()
        assert status.applied_step == 9 and status.last_error is None
        assert status.counters.downloaded_bytes["delta"] > 0
        with pytest.raises(DeltaSyncError, match="not staged"):
            poller.state.take(42)
    finally:
        poller.close()


def test_staging_is_bounded_and_resumes_when_taken(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    w, g = _weights(2), torch.Generator().manual_seed(3)
    with DeltaPublisher(url, anchor_every=100) as pub:
        for step in range(6):
            _step(w, g)
            pub.publish(step, w.items())
    poller = Poller(SyncConfig(url=url, poll_interval_s=0.05, max_staged_bytes=1), _patches_bytes)
    poller.start()
    try:
        _wait(lambda: poller.ready_steps() == [0])
        time.sleep(0.3)
        assert poller.ready_steps() == [0], "staged past max_staged_bytes"
        taken = poller.state.take(0)
        poller.state.mark_applied(taken[0].manifest)
        _wait(lambda: poller.ready_steps() == [1])
    finally:
        poller.close()


def test_fingerprint_mismatch_is_reported_and_nothing_is_staged(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    with DeltaPublisher(url) as pub:
        pub.publish(0, _weights(0).items())
    other = fingerprint([("w", (64, 48), "bfloat16")])
    poller = Poller(SyncConfig(url=url, poll_interval_s=0.05), _patches_bytes, fingerprint=other)
    poller.start()
    try:
        _wait(lambda: poller.status().last_error is not None)
        assert "FingerprintError" in poller.status().last_error
        assert poller.ready_steps() == []
    finally:
        poller.close()




def test_on_start_wait_stages_nothing_until_a_newer_step(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    w, g = _weights(4), torch.Generator().manual_seed(5)
    with DeltaPublisher(url, anchor_every=100) as pub:
        for step in range(3):
            _step(w, g)
            pub.publish(step, w.items())
        pub.flush()
        poller = Poller(SyncConfig(url=url, poll_interval_s=0.05, on_start="wait"),
                        _patches_bytes)
        poller.start()
        try:
            time.sleep(0.5)
            assert poller.ready_steps() == []
            assert poller.status().newest_step == 2
            _step(w, g)
            pub.publish(3, w.items())
            pub.flush()
            _wait(lambda: poller.ready_steps() == [0, 1, 2, 3])  # through the anchor
        finally:
            poller.close()


def test_loaded_step_lets_deltas_apply_without_the_anchor(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    w, g = _weights(6), torch.Generator().manual_seed(7)
    with DeltaPublisher(url, anchor_every=100) as pub:
        for step in range(4):
            _step(w, g)
            pub.publish(step, w.items())
    poller = Poller(SyncConfig(url=url, poll_interval_s=0.05, loaded_step=1), _patches_bytes,
                    applied_step=1)
    poller.start()
    try:
        _wait(lambda: poller.ready_steps() == [2, 3])
    finally:
        poller.close()


def test_a_step_being_applied_is_the_base_of_the_next_plan(tmp_path: Path) -> None:
    """Between take() and mark_applied() (the worker writing) the poller must not replan from
    the old applied step: it staged the anchor twice once, which stalled a TP=2 engine."""
    url = f"file://{tmp_path}/bucket"
    w, g = _weights(8), torch.Generator().manual_seed(9)
    with DeltaPublisher(url, anchor_every=100) as pub:
        pub.publish(0, w.items())
        pub.flush()
        poller = Poller(SyncConfig(url=url, poll_interval_s=0.05), _patches_bytes)
        poller.start()
        try:
            _wait(lambda: poller.ready_steps() == [0])
            (taken,) = poller.state.take(0)  # the worker is "writing" step 0 from here on
            _step(w, g)
            pub.publish(1, w.items())
            pub.flush()
            _wait(lambda: 1 in poller.ready_steps())
            time.sleep(0.2)
            assert poller.ready_steps() == [1]
            poller.state.mark_applied(taken.manifest)
            assert poller.ready_steps() == [1] and poller.state.applied_step == 0
        finally:
            poller.close()


def test_a_switch_taken_back_waits_for_a_newer_anchor(tmp_path: Path) -> None:
    """After rewind() the applied step is the one before the failed switch; the failed step,
    and every chain through it, is never staged again; the next anchor after it is."""
    url = f"file://{tmp_path}/bucket"
    w, g = _weights(10), torch.Generator().manual_seed(11)
    with DeltaPublisher(url, anchor_every=4) as pub:  # anchors at 0 and 4
        for step in range(3):
            _step(w, g)
            pub.publish(step, w.items())
        pub.flush()
        poller = Poller(SyncConfig(url=url, poll_interval_s=0.05), _patches_bytes)
        poller.start()
        try:
            _wait(lambda: poller.ready_steps() == [0, 1, 2])
            for staged in poller.state.take(1):
                poller.state.mark_applied(staged.manifest)
            before = poller.state.applied
            (failed,) = poller.state.take(2)
            poller.state.mark_applied(failed.manifest)  # one rank wrote it, another failed it
            poller.state.rewind(before, 2, "rank 1 failed step 2")
            assert poller.state.applied_step == 1 and poller.state.applied == before
            _step(w, g)
            pub.publish(3, w.items())  # a delta on the failed step: never staged
            pub.flush()
            time.sleep(0.5)
            assert poller.ready_steps() == []
            assert poller.status().applied_step == 1
            _step(w, g)
            pub.publish(4, w.items())  # an anchor: the way back
            pub.flush()
            _wait(lambda: poller.ready_steps() == [4])
            (anchor,) = poller.state.take(4)
            assert anchor.manifest.kind == "anchor"
            poller.state.mark_applied(anchor.manifest)
            _step(w, g)
            pub.publish(5, w.items())
            pub.flush()
            _wait(lambda: poller.ready_steps() == [5])  # deltas chain again after it
        finally:
            poller.close()

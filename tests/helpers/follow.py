"""A rank without vLLM, and the small trainer helpers the follow tests share.

``Follower`` runs the real poller (the rank's ``Poller`` and ``SyncState``) against a real
bucket; it takes the staged steps, checks them with the rank's own chain check
(``switching.check_chain``, what ``RankSwitch.apply`` runs before it writes anything) and writes
them into a dict of live tensors. The ``follower_factory`` fixture
(tests/server/worker/conftest.py) starts followers and closes them after the test.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_deltasync import DeltaPublisher
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.format.layout import manifest_path
from vllm_deltasync.server.worker.poller import Poller
from vllm_deltasync.server.worker.state import StagedStep
from vllm_deltasync.server.worker.switching import check_chain

Weights = dict[str, torch.Tensor]


def seeded_weights(seed: int) -> Weights:
    """Two small bf16 tensors (a matrix and a norm-like vector) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {"w": (torch.randn(64, 48, generator=g) * 0.02).bfloat16(),
            "b": (1 + 0.1 * torch.randn(96, generator=g)).bfloat16()}


def train(w: Weights, g: torch.Generator) -> None:
    """One step: 5% of the elements of each tensor move by one ulp, in place."""
    for t in w.values():
        bits = t.view(torch.int16).reshape(-1)
        bits[torch.rand(bits.numel(), generator=g) < 0.05] += 1


def clone(w: Weights) -> Weights:
    return {k: v.clone() for k, v in w.items()}


def publish_steps(pub: DeltaPublisher, w: Weights, g: torch.Generator, steps: range,
                  truth: dict[int, Weights]) -> None:
    """Train ``w`` one step per step of ``steps``, publish and flush each, record it in
    ``truth``."""
    for step in steps:
        train(w, g)
        pub.publish(step, clone(w).items())
        pub.flush()
        truth[step] = clone(w)


def remove_steps(root: Path, steps: list[int]) -> None:
    """What an operator does by hand after a preemption: remove the steps after the checkpoint
    (their manifests and data folders) from the ``file://`` bucket at ``root``."""
    for step in steps:
        (root / manifest_path(step)).unlink()
        for folder in (root / "data").glob(f"{step:012d}-*"):
            shutil.rmtree(folder)


def _patches(manifest: Any, patches: list[Any]) -> tuple[list[Any], int]:
    return patches, sum(p.values.numel() * p.values.element_size() for p in patches)


class Follower:
    """A rank without vLLM: the real poller, the rank's chain check, live tensors.
    ``options`` are ``SyncConfig`` fields (``poll_interval_s`` defaults to 0.05 here)."""

    def __init__(self, url: str, live: Weights, **options: Any) -> None:
        cfg = SyncConfig(**{"url": url, "poll_interval_s": 0.05, **options})
        self.poller = Poller(cfg, _patches, applied_step=cfg.loaded_step)  # as TargetRank does
        self.poller.branch_check_s = 0.3
        self.live = live
        self.applied: list[tuple[int, str | None]] = []

    @property
    def state(self) -> Any:
        return self.poller.state

    def apply_ready(self) -> None:
        ready = self.state.ready_steps()
        if not ready:
            return
        before = self.state.applied
        self.write(before, self.state.take(ready[-1]))

    def write(self, before: Any, taken: list[StagedStep[Any]]) -> None:
        """The second half of a switch: what ``state.take`` returned, onto ``before`` (the
        applied step when it was taken)."""
        check_chain(0, before, taken, taken[-1].manifest.identity)  # raises: never across
        for staged in taken:
            for p in staged.payload:
                p.apply_to(self.live[p.name].view(-1))
            if self.state.mark_applied(staged.manifest) is not None:
                self.poller.stats.add_branch_change()  # as RankSwitch.apply: a restart's anchor
            self.applied.append((staged.step, staged.manifest.identity))

    def follow_until(self, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out; status {self.poller.status()}"
            self.apply_ready()
            time.sleep(0.02)

    def at(self, step: int, truth: Weights) -> bool:
        return self.state.applied_step == step and all(
            torch.equal(self.live[k], truth[k]) for k in truth)

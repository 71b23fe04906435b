"""``drafter_prefix``: a draft head's tensors travel in the policy's own bucket (issue 26).

Two real ``TargetRank``s, the policy's and the drafter's (vLLM's own Llama module each, real
shard maps and pollers) follow one
file:// bucket into which a trainer publishes a policy and, under ``head.``, a second model of
the same shapes trained apart (as an EAGLE head is trained beside the policy). The policy's
state reads only the unprefixed tensors, the drafter's only the prefixed ones, the prefix
removed; both check the whole bucket's fingerprint; each ends bit for bit on its own weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.tp_world import TPWorld, live_checkpoint, target_rank
from tests.helpers.waiting import wait_until
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.server.messages import CommitOutcome
from vllm_deltasync.server.targets import DRAFTER
from vllm_deltasync.server.vllm.loaders import LOADER
from vllm_deltasync.server.worker.apply import checkpoint_digest, tensor_digest
from vllm_deltasync.server.worker.checkpoint import checkpoint_params
from vllm_deltasync.server.worker.rank import Rank
from vllm_deltasync.server.worker.target import TargetRank, bucket_params
from vllm_deltasync.server.worker.view import WorkerView


def _train(state: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in state.values():
        bits = t.view(torch.int16).reshape(-1)
        mask = torch.rand(bits.numel(), generator=gen) < 0.02
        bits[mask] += 1


def _apply_ready(rank: TargetRank, step: int) -> None:
    wait_until(lambda: step in rank.sync.ready_steps() or rank.status().last_error is not None,
               30, f"step {step} staged", status=rank.status)
    assert rank.status().last_error is None, rank.status().last_error
    assert rank.switch.apply(step).ok
    assert rank.switch.commit(step).outcome is CommitOutcome.COMMITTED


def test_policy_and_head_split_one_bucket(tp_world: TPWorld, tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    p_ckpt, p_live, policy = live_checkpoint(tp_world, tmp_path / "p", "llama_gqa", seed=21)
    d_ckpt, d_live, head = live_checkpoint(tp_world, tmp_path / "d", "llama_gqa", seed=22)
    url = f"file://{tmp_path}/bucket"
    config = SyncConfig(url=url, poll_interval_s=0.01, drafter_prefix="head.")
    with DeltaPublisher(url, anchor_every=100) as pub:
        pub.publish(0, [*policy.items(), *((f"head.{n}", t) for n, t in head.items())])
        for step in (1, 2):
            _train(policy, seed=step)
            _train(head, seed=100 + step)
            pub.publish(step, [*policy.items(), *((f"head.{n}", t) for n, t in head.items())])
    whole = bucket_params(checkpoint_params(str(p_ckpt)),
                          {"head.": checkpoint_params(str(d_ckpt))})
    ranks = [target_rank(p_live, p_ckpt, config, bucket_params=whole),
             target_rank(p_live, p_ckpt, config, row=DRAFTER, weights=(d_live, d_ckpt),
                         bucket_params=whole)]
    assert ranks[0].fingerprint == ranks[1].fingerprint is not None
    try:
        for rank in ranks:
            rank.follow()
        for rank in ranks:
            _apply_ready(rank, 2)
        for rank, want in zip(ranks, (policy, head), strict=True):
            for name, tensor in want.items():
                if name in rank.shardmap.ignored or name in rank.shardmap.covered_by:
                    continue
                assert tensor_digest(rank.shardmap, name) == checkpoint_digest(
                    rank.shardmap, name, tensor), (rank.name, name)
        # each downloaded only its own tensors (the two models are the same size)
        got = [r.status().counters.downloaded_bytes for r in ranks]
        assert all(0.8 < g["delta"] / got[0]["delta"] < 1.25 for g in got), got
    finally:
        for rank in ranks:
            rank.close()


def test_a_fingerprint_without_the_head_is_refused(tp_world: TPWorld, tmp_path: Path) -> None:
    """The policy expects the bucket's whole parameter set: a bucket without the head (the
    trainer forgot it) is another parameter set, and its steps are refused, not half-applied."""
    p_ckpt, p_live, policy = live_checkpoint(tp_world, tmp_path, "llama_gqa", seed=23)
    url = f"file://{tmp_path}/bucket"
    whole = {**checkpoint_params(str(p_ckpt)), "head.fc.weight": ((4, 4), "BF16")}
    with DeltaPublisher(url, anchor_every=100) as pub:
        pub.publish(0, policy.items())
    rank = target_rank(p_live, p_ckpt, SyncConfig(url=url, poll_interval_s=0.01,
                                                  drafter_prefix="head."), bucket_params=whole)
    try:
        rank.follow()
        wait_until(lambda: "fingerprint" in str(rank.status().last_error), 30,
                   "the fingerprint refusal", status=rank.status)
        assert rank.sync.ready_steps() == []
    finally:
        rank.close()


def test_S1_a_drafter_prefix_matching_policy_tensors_is_refused_at_start(
        tp_world: TPWorld, tmp_path: Path) -> None:
    """Red team S1: ``drafter_prefix="model."`` (every policy tensor but the lm_head starts with
    it), with or without a draft model: the policy would skip its own anchor tensors and report
    steps applied that it never wrote. Refused at start, with one line naming the option."""
    p_ckpt, p_live, _ = live_checkpoint(tp_world, tmp_path, "llama_gqa", seed=24)
    config = SyncConfig(url=f"file://{tmp_path}/bucket", drafter_prefix="model.")
    for drafter in (None, (p_live, str(p_ckpt))):
        view = WorkerView(rank=0, model=p_live, model_path=str(p_ckpt), loader=LOADER,
                          drafter=drafter)
        with pytest.raises(ConfigError) as err:
            Rank.build(view, config, missing=lambda scope: [])
        message = str(err.value)
        assert "'model.'" in message and "drafter_prefix" in message and "\n" not in message
        assert "policy" in message and "e.g. 'model." in message

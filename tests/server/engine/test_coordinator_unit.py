"""The engine core's coordinator without an engine: a switch is one unit whatever fails.

A real :class:`Coordinator` drives the stand-in engine core of tests/helpers/fake_engine.py, whose
``collective_rpc`` runs each method on every rank object in order, as vLLM's workers do (all
ranks run a broadcast, then the first failure is raised), and whose ranks answer the wire
protocol of ``server/messages.py`` per target. Failures are injected per rank and method: an
apply that raises out of the RPC after rank 0 wrote, a broadcast that times out after every
rank ran it, a revert that answers ``unknown`` or raises, a commit broadcast that fails. The
same follower switches the policy and the drafter: a drafter's failures never hold the engine.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.helpers.fake_engine import FakeEngine as Engine
from tests.helpers.fake_engine import FakeRank as Rank
from tests.helpers.fake_engine import make_coordinator, once
from vllm_deltasync.server.engine.coordinator import Coordinator
from vllm_deltasync.server.engine.ready import common_ready, staged_target
from vllm_deltasync.server.engine.switch import CommitFailed
from vllm_deltasync.server.messages import TargetStatus


def coordinator(ranks: list[Rank], **config: Any) -> tuple[Coordinator, Engine]:
    return make_coordinator(ranks, **config)


def consistent(engine: Engine, model: str = "policy") -> set[Any]:
    return {(r.targets[model].applied, r.targets[model].weights) for r in engine.ranks}


# ------------------------------------------------------------------ which step is common


def _status(rank: int, applied: int | None, ready: list[int], ids: list[str] | None = None,
            applied_id: str | None = "default") -> TargetStatus:
    return TargetStatus(rank=rank, model="policy", applied_step=applied,
                        applied_id=(f"sha256:{applied}" if applied_id == "default" and applied
                                    is not None else None if applied_id == "default"
                                    else applied_id),
                        ready_steps=tuple(ready),
                        ready_ids=tuple(ids if ids is not None else [f"sha256:{s}" for s in ready]))


def test_the_common_step_needs_the_same_applied_identity_and_the_same_target() -> None:
    a = _status(0, 2, [3, 4])
    assert common_ready([a, _status(1, 2, [3, 4])]) == (4, "sha256:4")
    rewritten = _status(1, 2, [3, 4], ["sha256:3", "sha256:4-rewritten"])
    assert common_ready([a, rewritten]) == (3, "sha256:3")
    assert common_ready([a, _status(1, 2, [3, 4], applied_id="sha256:b")]) is None
    assert common_ready([a, _status(1, 2, [])]) is None
    assert common_ready([a, _status(1, 1, [3, 4])]) is None
    assert common_ready([]) is None


def test_ranks_that_planned_different_chains_still_switch_to_the_step_they_share() -> None:
    """One rank reached step 10 through anchor 8, the other through deltas 5..10: the same
    manifest at the end, so both switch to it (the stall of issue 34 was a rank whose staged
    list did not share the other's prefix: nothing ever became common)."""
    held = [_status(0, None, [5, 6, 10]), _status(1, None, [8, 10])]
    assert common_ready(held) == (10, "sha256:10")
    following = [_status(0, 4, [5, 6, 7]), _status(1, 4, [6, 7])]
    assert common_ready(following) == (7, "sha256:7")
    assert common_ready([held[0], _status(1, None, [10], ["sha256:10b"])]) is None
    assert common_ready([_status(0, 2, [10]), held[1]]) is None


def test_the_trainer_step_must_be_staged_everywhere_with_its_identity() -> None:
    ranks = [_status(0, 2, [3, 4]), _status(1, 2, [4])]
    assert staged_target(ranks, 4, "sha256:4") == (4, "sha256:4")
    assert staged_target(ranks, 4, None) == (4, "sha256:4")
    assert staged_target(ranks, 4, "sha256:other") is None
    assert staged_target(ranks, 3, None) is None


def test_the_switch_passes_the_identity_and_commits() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    coord.tick()
    assert consistent(engine) == {(3, 3)} and engine.version == "3"
    assert all(r.pending is None for r in engine.ranks)
    assert coord.primary.switches[-1].identity == "sha256:3" and coord.held is None


# ------------------------------------------------------------------ the apply broadcast fails


def test_apply_broadcast_failing_after_rank_0_wrote_is_reverted_on_every_rank() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    engine.ranks[1].fail["deltasync_apply"] = once(RuntimeError("boom"))
    coord.tick()
    assert engine.calls == ["deltasync_status", "deltasync_apply", "deltasync_revert"]
    assert consistent(engine) == {(2, 2)}, "rank 0's write was not taken back"
    assert engine.version == "2" and coord.held is None
    assert engine.paused == "none"
    assert coord.failed_ticks == 1 and "apply broadcast failed" in (coord.last_error or "")


def test_apply_broadcast_timing_out_after_every_rank_wrote_is_reverted() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    engine.broadcast_fail["deltasync_apply"] = TimeoutError("RPC call to deltasync_apply timed out.")
    coord.tick()
    assert consistent(engine) == {(2, 2)} and engine.version == "2" and coord.held is None
    assert "TimeoutError" in (coord.last_error or "")


def test_a_rank_that_cannot_take_it_back_holds_until_an_anchor_applies_everywhere() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    engine.ranks[1].dirty = True  # as if it failed mid-write without putting back
    engine.ranks[1].fail["deltasync_apply"] = once(RuntimeError("boom"))
    engine.ranks[1].weights = "mixed"
    coord.tick()
    assert "deltasync_revert" in engine.calls and "deltasync_reset" in engine.calls
    assert coord.held is not None and engine.version == "inconsistent"
    assert engine.paused == "all"
    assert all(r.applied is None for r in engine.ranks)
    ok, body = coord.metrics.synced()
    assert not ok and "SwitchHeld" in body["coordinator"]["last_error"]
    assert "could not take it back" in body["coordinator"]["last_error"]
    assert coord.engine_status()["failing"] and coord.engine_status()["held"]

    coord.tick()  # nothing staged yet: still held, nothing unpaused
    assert coord.held is not None and engine.paused == "all"
    assert not coord.metrics.synced()[0]
    # the ranks wait for different anchors (rank 0 dropped the failed step): their queues
    # share no prefix, but both reach anchor 10 from nothing
    engine.ranks[0].ready, engine.ranks[1].ready = [10], [5, 6, 10]
    coord.tick()
    assert consistent(engine) == {(10, 10)} and engine.version == "10"
    assert coord.held is None and engine.paused == "none"
    assert coord.primary.holds[-1]["released_step"] == 10
    assert coord.metrics.synced()[1]["coordinator"]["failing"] is False


def test_the_hold_sends_reset_again_to_a_rank_it_did_not_reach() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    engine.ranks[1].dirty = True
    engine.ranks[1].fail["deltasync_apply"] = once(RuntimeError("boom"))
    engine.ranks[0].fail["deltasync_reset"] = once(RuntimeError("lost"))
    coord.tick()
    assert coord.held is not None and engine.ranks[0].applied == 2  # the reset did not land
    del engine.ranks[0].fail["deltasync_reset"]
    engine.ranks[0].ready, engine.ranks[1].ready = [5], [5]
    coord.tick()  # rank 0 still reports a step: reset again, no switch
    assert engine.calls[-1] == "deltasync_reset" and coord.held is not None
    assert engine.ranks[0].applied is None and engine.version == "inconsistent"
    engine.ranks[0].ready, engine.ranks[1].ready = [5], [5]
    coord.tick()
    assert coord.held is None and consistent(engine) == {(5, 5)}


def test_the_hold_is_not_released_by_a_drain_or_a_resume() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)], in_flight="drain")
    engine.unfinished = True
    coord.tick()  # drain starts: new requests paused by the coordinator
    assert engine.paused == "new"
    engine.unfinished = False
    engine.ranks[1].dirty = True
    engine.ranks[1].fail["deltasync_apply"] = once(RuntimeError("boom"))
    coord.tick()
    assert coord.held is not None and engine.paused == "all"
    coord.tick()  # nothing common is ready: the drain is released, the hold is not
    assert engine.paused == "all"
    engine.set_pause("none")  # someone resumed the engine
    coord.tick()
    assert engine.paused == "all"


def test_the_revert_broadcast_failing_holds() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    engine.ranks[1].fail["deltasync_apply"] = once(RuntimeError("boom"))
    engine.broadcast_fail["deltasync_revert"] = TimeoutError("revert timed out")
    coord.tick()
    assert coord.held is not None and "revert broadcast failed too" in coord.held
    assert engine.version == "inconsistent" and engine.paused == "all"
    assert all(r.applied is None for r in engine.ranks)


def test_a_misplaced_answer_is_a_failure_never_a_success() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    apply = engine.ranks[1].deltasync_apply
    engine.ranks[1].deltasync_apply = lambda step, identity=None, model="policy": (  # type: ignore[method-assign]
        apply(step, identity, model), {"rank": 1, "outcome": "put_back"})[1]  # wrote, then answered like a revert
    coord.tick()  # nobody knows what rank 1 did: hold, every rank resyncs through an anchor
    assert coord.held is not None and "no answer to deltasync_apply(3)" in coord.held
    assert engine.version == "inconsistent" and all(r.applied is None for r in engine.ranks)


def test_the_engine_core_failing_after_the_apply_is_reverted() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])

    def fail(version: str) -> None:
        raise RuntimeError("set_weight_version failed")

    engine.set_weight_version = fail  # type: ignore[method-assign]
    coord.tick()
    assert consistent(engine) == {(2, 2)} and engine.version == "2" and coord.held is None


# ------------------------------------------------------------------ the commit broadcast fails


def test_a_failed_commit_leaves_the_switch_standing_and_is_sent_again() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    engine.ranks[1].fail["deltasync_commit"] = once(RuntimeError("gone"))
    for r in engine.ranks:
        r.ready = [3, 4]
    coord.tick(from_steps=True)
    assert coord.failed_ticks == 1 and isinstance(coord, Coordinator)
    assert CommitFailed.__name__ in (coord.last_error or "")
    assert consistent(engine) == {(4, 4)} and engine.version == "4"
    assert [r.pending for r in engine.ranks] == [None, (4, 2)]
    assert coord.primary.failures == 0  # the switch stands: not a failed switch
    del engine.ranks[1].fail["deltasync_commit"]
    for r in engine.ranks:
        r.ready = [5]
    coord.tick()  # a rank has a pending switch: commit again, no switch
    assert engine.calls[-1] == "deltasync_commit" and engine.version == "4"
    assert all(r.pending is None for r in engine.ranks)
    coord.tick()
    assert engine.version == "5" and coord.failed_ticks == 0


def test_a_pending_switch_nobody_left_holds() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    engine.ranks[0].deltasync_apply(3, "sha256:3")  # someone applied by hand, on rank 0 only
    coord.tick()
    assert coord.held is not None and "pending policy switch" in coord.held
    assert engine.version == "inconsistent"


# ------------------------------------------------------------------ a step that stays staged


def test_a_step_staged_but_not_switched_is_logged_once_with_every_rank(
        caplog: pytest.LogCaptureFixture) -> None:
    from vllm_deltasync.server.engine.follower import STAGED_TICKS

    ranks = [Rank(0, applied=2, ready=(3,)), Rank(1, applied=2, ready=())]
    coord, engine = coordinator(ranks)
    with caplog.at_level(logging.WARNING, logger="vllm_deltasync.server.engine.follower"):
        for _ in range(STAGED_TICKS - 1):
            coord.tick()
        assert not [r for r in caplog.records if "has not been switched" in r.message]
        for _ in range(3):
            coord.tick()
    [line] = [r.message for r in caplog.records if "has not been switched" in r.message]
    assert "no step staged on every rank" in line and "rank 0: applied=2 ready=[3]" in line
    assert line.startswith("deltasync policy:")
    assert "rank 1: applied=2 ready=[]" in line
    ranks[1].ready = [3]  # the slow rank catches up: the switch goes through
    coord.tick()
    assert {r.applied for r in ranks} == {3} and engine.version == "3"


# ------------------------------------------------------------------ the drafter: the same switch


def both(**kw: Any) -> list[Rank]:
    return [Rank(0, targets=("policy", "drafter"), **kw), Rank(1, targets=("policy", "drafter"), **kw)]


def test_the_drafter_and_the_policy_switch_in_one_tick_through_one_switch() -> None:
    coord, engine = coordinator(both())
    coord.tick()
    assert consistent(engine, "policy") == consistent(engine, "drafter") == {(3, 3)}
    assert engine.calls.count("deltasync_apply") == 2 and engine.version == "3"
    assert engine.prefix_resets == 0  # no switch drops the prefix cache: requests are salted
    assert coord.kv.identities == {"policy": "sha256:3"}  # by the policy only, not the drafter
    status = coord.engine_status()
    assert status["drafter"]["switches"][-1]["step"] == 3 and status["switches"][-1]["step"] == 3


def test_a_drafter_that_cannot_take_back_resyncs_without_holding_the_engine() -> None:
    coord, engine = coordinator(both())
    d1 = engine.ranks[1].targets["drafter"]
    d1.dirty = True
    real = engine.ranks[1].deltasync_apply

    def apply(step: int, identity: str | None = None, model: str = "policy") -> Any:
        if model == "drafter":
            raise RuntimeError("drafter boom")
        return real(step, identity, model)

    engine.ranks[1].deltasync_apply = apply  # type: ignore[method-assign]
    coord.tick()
    assert coord.followers["drafter"].held is not None and coord.held is None
    assert engine.paused == "none" and coord.failed_ticks == 0
    assert {r.targets["drafter"].applied for r in engine.ranks} == {None}  # resync via anchor
    assert consistent(engine, "policy") == {(3, 3)} and engine.version == "3"
    ok, body = coord.metrics.synced()
    assert ok and body["drafter_synced"] is False or body.get("drafter") is not None


def test_a_drafter_commit_that_failed_is_sent_again_like_the_policys() -> None:
    """One meaning of every outcome: a failed commit leaves the switch standing on every rank
    (it is sent again), for the drafter as for the policy; never taken back on some ranks."""
    coord, engine = coordinator(both())
    real = engine.ranks[1].deltasync_commit

    def commit(step: int, model: str = "policy") -> Any:
        if model == "drafter" and not getattr(commit, "fired", False):
            commit.fired = True  # type: ignore[attr-defined]
            return {"rank": 1, "outcome": "failed"}
        return real(step, model)

    engine.ranks[1].deltasync_commit = commit  # type: ignore[method-assign]
    coord.tick()
    assert consistent(engine, "drafter") == {(3, 3)}
    assert [r.targets["drafter"].pending for r in engine.ranks] == [None, (3, 2)]
    assert "deltasync_revert" not in engine.calls
    coord.tick()  # sent again
    assert [r.targets["drafter"].pending for r in engine.ranks] == [None, None]
    assert consistent(engine, "drafter") == {(3, 3)}

"""The engine core's coordinator without an engine: a switch is one unit whatever fails.

A real :class:`Coordinator` drives a small engine whose ``collective_rpc`` runs each method on
every rank object in order, as vLLM's workers do (all ranks run a broadcast, then the first
failure is raised), and whose ranks keep their switch state the way ``RankState`` does: the
applied step, the weights (a step, or "mixed" when half written), a pending switch. Failures
are injected per rank and method: an apply that raises out of the RPC after rank 0 wrote, a
broadcast that times out after every rank ran it, a revert that answers False or raises, a
commit broadcast that fails.

Also the worker side (``DeltaSyncExtension.deltasync_apply`` / ``deltasync_revert``) on a
stand-in rank state with a real ``SyncState``: a ``BaseException`` out of the apply is answered
(not raised), and a rank that never wrote answers True to a revert.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

import pytest

from vllm_deltasync.config import SyncConfig
from vllm_deltasync.server.engine.coordinator import (
    CommitFailed,
    Coordinator,
    common_after_reset,
    common_ready,
    common_ready_step,
)


class Pause(enum.Enum):
    UNPAUSED = 0
    PAUSED_NEW = 1
    PAUSED_ALL = 2


class Scheduler:
    def __init__(self) -> None:
        self.pause_state = Pause.UNPAUSED
        self.unfinished = False

    def set_pause_state(self, state: Pause) -> None:
        self.pause_state = state

    def has_unfinished_requests(self) -> bool:
        return self.unfinished


class Rank:
    """One rank's switch state, as ``RankState`` keeps it (weights: a step or "mixed")."""

    def __init__(self, rank: int, applied: int | None = 2, ready: tuple[int, ...] = (3,)) -> None:
        self.rank = rank
        self.applied: int | None = applied
        self.weights: int | str | None = applied
        self.ready = list(ready)
        self.pending: tuple[int, int | None] | None = None
        self.dirty = False
        self.fail: dict[str, Callable[[], Any]] = {}

    def ids(self, step: int | None) -> str | None:
        return None if step is None else f"sha256:{step}"

    def deltasync_status(self) -> dict[str, Any]:
        return {"rank": self.rank, "applied_step": self.applied, "applied_id": self.ids(self.applied),
                "ready_steps": list(self.ready), "ready_ids": [self.ids(s) for s in self.ready],
                "pending_switch": self.pending[0] if self.pending else None,
                "newest_step": max(self.ready, default=self.applied), "last_error": None}

    def deltasync_apply(self, step: int, identity: str | None = None) -> dict[str, Any]:
        assert step in self.ready and identity == self.ids(step), (step, identity, self.ready)
        chain = [s for s in self.ready if s <= step]
        if chain[0] == 0 or self.applied is None:  # an anchor (step 0, or after a reset)
            assert self.applied is None or chain[0] == 0
        self.pending = (step, self.applied)
        self.applied = self.weights = step
        self.ready = [s for s in self.ready if s > step]
        return {"ok": True, "rank": self.rank, "steps": chain, "kinds": ["delta"] * len(chain)}

    def deltasync_commit(self, step: int) -> bool:
        if self.pending is None or self.pending[0] != step:
            return False
        self.pending = None
        return True

    def deltasync_revert(self, step: int, reason: str, before: dict[str, Any] | None = None) -> bool:
        if self.pending is not None and self.pending[0] == step:
            self.applied = self.weights = self.pending[1]
            self.pending, self.ready = None, []
            return True
        if (not self.dirty and before is not None and self.applied == before["applied_step"]
                and self.weights == self.applied):
            self.ready = []
            return True
        self.deltasync_reset(reason)
        return False

    def deltasync_reset(self, reason: str) -> None:
        self.applied, self.pending, self.ready, self.dirty = None, None, [], False


class Engine:
    """The part of vLLM's EngineCore the coordinator calls."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks
        self.scheduler = Scheduler()
        self.version = "2"
        self.calls: list[str] = []
        self.prefix_resets = 0
        self.broadcast_fail: dict[str, BaseException] = {}
        """method -> raised after every rank ran it (a timeout that came late)."""

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        self.calls.append(method)
        out, first = [], None
        for r in self.ranks:  # every worker runs the broadcast; the first failure is raised
            try:
                if method in r.fail:
                    r.fail[method]()
                out.append(getattr(r, method)(*args, **(kwargs or {})))
            except Exception as exc:  # noqa: BLE001
                first = first or exc
        if first is not None:
            raise RuntimeError(f"Worker failed with error '{first}'")
        if method in self.broadcast_fail:
            raise self.broadcast_fail.pop(method)
        return out

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.prefix_resets += 1
        return True

    def set_weight_version(self, version: str) -> None:
        self.version = version

    def get_weight_version(self) -> str:
        return self.version


def once(exc: BaseException) -> Callable[[], None]:
    """A failure injected once (the next call goes through)."""
    fired: list[bool] = []

    def fail() -> None:
        if not fired:
            fired.append(True)
            raise exc

    return fail


def coordinator(ranks: list[Rank], **config: Any) -> tuple[Coordinator, Engine]:
    engine = Engine(ranks)
    coord = Coordinator(engine, SyncConfig(url="file:///tmp/bucket", metrics_port=0, **config),
                        wake=None, pause_states=Pause)
    coord.active = True
    return coord, engine


def consistent(engine: Engine) -> set[Any]:
    return {(r.applied, r.weights) for r in engine.ranks}


# ------------------------------------------------------------------ common_ready_step


def test_common_ready_step_needs_the_same_identities() -> None:
    a = {"applied_step": 2, "applied_id": "sha256:a", "ready_steps": [3, 4],
         "ready_ids": ["sha256:3", "sha256:4"]}
    assert common_ready([a, dict(a)]) == (4, "sha256:4")
    other = dict(a, ready_ids=["sha256:3", "sha256:4-rewritten"])
    assert common_ready([a, other]) == (3, "sha256:3")
    assert common_ready_step([a, dict(a, ready_ids=["sha256:x", "sha256:4"])]) is None
    assert common_ready_step([a, dict(a, applied_id="sha256:b")]) is None  # same step, other id
    assert common_ready_step([a, {k: v for k, v in a.items() if k != "applied_id"}]) is None
    old = [{"applied_step": 2, "ready_steps": [3, 4]}, {"applied_step": 2, "ready_steps": [3]}]
    assert common_ready(old) == (3, None)  # older statuses: steps only
    assert common_ready_step([{"applied_step": 2, "ready_steps": [3]},
                              {"applied_step": 1, "ready_steps": [3]}]) is None
    assert common_ready_step([]) is None
    held = [{"applied_step": None, "ready_steps": [5, 6, 10], "ready_ids": ["5", "6", "10"]},
            {"applied_step": None, "ready_steps": [10], "ready_ids": ["10"]}]
    assert common_ready(held) is None and common_after_reset(held) == (10, "10")
    assert common_after_reset([held[0], dict(held[1], ready_ids=["10b"])]) is None
    assert common_after_reset([dict(held[0], applied_step=2), held[1]]) is None


def test_the_switch_passes_the_identity_and_commits() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    coord.tick()
    assert consistent(engine) == {(3, 3)} and engine.version == "3"
    assert all(r.pending is None for r in engine.ranks)
    assert coord.switches[-1]["identity"] == "sha256:3" and coord.held is None


# ------------------------------------------------------------------ the apply broadcast fails


def test_apply_broadcast_failing_after_rank_0_wrote_is_reverted_on_every_rank() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    engine.ranks[1].fail["deltasync_apply"] = once(RuntimeError("boom"))
    coord.tick()
    assert engine.calls == ["deltasync_status", "deltasync_apply", "deltasync_revert"]
    assert consistent(engine) == {(2, 2)}, "rank 0's write was not taken back"
    assert engine.version == "2" and coord.held is None
    assert engine.scheduler.pause_state is Pause.UNPAUSED
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
    assert engine.scheduler.pause_state is Pause.PAUSED_ALL
    assert all(r.applied is None for r in engine.ranks)
    ok, body = coord.metrics.synced()
    assert not ok and "SwitchHeld" in body["coordinator"]["last_error"]
    assert "could not take it back" in body["coordinator"]["last_error"]
    assert coord.engine_status()["failing"] and coord.engine_status()["held"]

    coord.tick()  # nothing staged yet: still held, nothing unpaused
    assert coord.held is not None and engine.scheduler.pause_state is Pause.PAUSED_ALL
    assert not coord.metrics.synced()[0]
    # the ranks wait for different anchors (rank 0 dropped the failed step): their queues
    # share no prefix, but both reach anchor 10 from nothing
    engine.ranks[0].ready, engine.ranks[1].ready = [10], [5, 6, 10]
    coord.tick()
    assert consistent(engine) == {(10, 10)} and engine.version == "10"
    assert coord.held is None and engine.scheduler.pause_state is Pause.UNPAUSED
    assert coord.holds[-1]["released_step"] == 10
    assert coord.metrics.synced()[1]["coordinator"]["failing"] is False


def test_the_hold_sends_reset_again_to_a_rank_it_did_not_reach() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    engine.ranks[1].dirty = True
    engine.ranks[1].fail["deltasync_apply"] = once(RuntimeError("boom"))
    reset = Rank.deltasync_reset
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
    assert reset is Rank.deltasync_reset


def test_the_hold_is_not_released_by_a_drain_or_a_resume() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)], in_flight="drain")
    engine.scheduler.unfinished = True
    coord.tick()  # drain starts: new requests paused by the coordinator
    assert engine.scheduler.pause_state is Pause.PAUSED_NEW
    engine.scheduler.unfinished = False
    engine.ranks[1].dirty = True
    engine.ranks[1].fail["deltasync_apply"] = once(RuntimeError("boom"))
    coord.tick()
    assert coord.held is not None and engine.scheduler.pause_state is Pause.PAUSED_ALL
    coord.tick()  # nothing common is ready: the drain is released, the hold is not
    assert engine.scheduler.pause_state is Pause.PAUSED_ALL
    engine.scheduler.set_pause_state(Pause.UNPAUSED)  # someone resumed the engine
    coord.tick()
    assert engine.scheduler.pause_state is Pause.PAUSED_ALL


def test_the_revert_broadcast_failing_holds() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    engine.ranks[1].fail["deltasync_apply"] = once(RuntimeError("boom"))
    engine.broadcast_fail["deltasync_revert"] = TimeoutError("revert timed out")
    coord.tick()
    assert coord.held is not None and "revert broadcast failed too" in coord.held
    assert engine.version == "inconsistent" and engine.scheduler.pause_state is Pause.PAUSED_ALL
    assert all(r.applied is None for r in engine.ranks)


def test_a_misplaced_answer_is_a_failure_never_a_success() -> None:
    coord, engine = coordinator([Rank(0), Rank(1)])
    apply = engine.ranks[1].deltasync_apply
    engine.ranks[1].deltasync_apply = lambda step, identity=None: (  # type: ignore[method-assign]
        apply(step, identity), True)[1]  # wrote, then answered like a revert
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
    assert coord.held is not None and "pending switch" in coord.held
    assert engine.version == "inconsistent"


# ------------------------------------------------------------------ the worker side


class _State:
    """A stand-in ``RankState`` with a real ``SyncState``."""

    def __init__(self, raise_in_apply: BaseException | None = None) -> None:
        from vllm_deltasync.server.worker.state import SyncState

        self.rank = 1
        self.sync: SyncState[Any] = SyncState(2)
        self.raise_in_apply = raise_in_apply
        self.resets: list[str] = []
        self.reverts: list[int] = []

    def apply(self, step: int, *, identity: str | None = None) -> dict[str, Any]:
        if self.raise_in_apply is not None:
            raise self.raise_in_apply
        return {"step": step, "identity": identity}

    def reset(self, reason: str) -> None:
        self.resets.append(reason)
        self.sync.reset(reason)

    def revert(self, step: int, reason: str) -> bool:
        self.reverts.append(step)
        self.reset(reason)
        return False


class _Abort(BaseException):
    pass


def _worker(state: _State) -> Any:
    from vllm_deltasync.server.extension import DeltaSyncExtension

    ext = DeltaSyncExtension()
    ext._deltasync = state  # type: ignore[assignment]
    return ext


def test_worker_answers_a_base_exception_out_of_the_apply() -> None:
    state = _State(_Abort("mid-write"))
    ext = _worker(state)
    out = ext.deltasync_apply(3, "sha256:3")
    assert out == {"ok": False, "rank": 1, "error": "_Abort: mid-write", "reverted": False}
    assert state.resets and state.sync.applied_step is None
    assert ext.deltasync_apply(4) == {"ok": False, "rank": 1, "error": "_Abort: mid-write",
                                      "reverted": False}
    state.raise_in_apply = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        ext.deltasync_apply(5)
    state.raise_in_apply = None
    assert ext.deltasync_apply(6, "sha256:6") == {"ok": True, "rank": 1, "step": 6,
                                                  "identity": "sha256:6"}


def test_worker_revert_of_a_step_it_never_wrote_keeps_its_weights() -> None:
    state = _State()
    ext = _worker(state)
    assert ext.deltasync_revert(3, "rank 0 failed", {"applied_step": 2, "applied_id": None})
    assert state.sync.applied_step == 2 and not state.reverts and state.sync.failed_steps([3]) == [3]
    assert not ext.deltasync_revert(3, "x", {"applied_step": 1, "applied_id": None})
    assert state.reverts == [3] and state.sync.applied_step is None
    dirty = _State()
    ext = _worker(dirty)
    ext._deltasync_writing = 3  # an apply that never answered
    assert not ext.deltasync_revert(3, "x", {"applied_step": 2, "applied_id": None})
    assert dirty.resets


# ------------------------------------------------------------------ a step that stays staged


def test_a_step_staged_but_not_switched_is_logged_once_with_every_rank(
        caplog: pytest.LogCaptureFixture) -> None:
    from vllm_deltasync.server.engine.coordinator import STAGED_TICKS

    ranks = [Rank(0, applied=2, ready=(3,)), Rank(1, applied=2, ready=())]
    coord, engine = coordinator(ranks)
    with caplog.at_level(logging.WARNING, logger="vllm_deltasync.server.engine.coordinator"):
        for _ in range(STAGED_TICKS - 1):
            coord.tick()
        assert not [r for r in caplog.records if "has not been switched" in r.message]
        for _ in range(3):
            coord.tick()
    [line] = [r.message for r in caplog.records if "has not been switched" in r.message]
    assert "no step staged on every rank" in line and "rank 0: applied=2 ready=[3]" in line
    assert "rank 1: applied=2 ready=[]" in line
    ranks[1].ready = [3]  # the slow rank catches up: the switch goes through
    coord.tick()
    assert {r.applied for r in ranks} == {3} and engine.version == "3"

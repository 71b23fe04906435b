"""The stand-in engine core and wire-speaking ranks the coordinator's unit tests drive.

The coordinator's unit tests drive a real ``Coordinator`` through a stand-in of vLLM's engine
core (a foreign component) whose ``collective_rpc`` runs each method on every rank object, as
vLLM's workers do (all ranks run a broadcast, then the first failure is raised). The ranks
speak the wire protocol of ``server/messages.py`` (what crosses vLLM's RPC); their switch
state is a step per target, or "mixed" when half written; failures are injected per method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vllm_deltasync.config import SyncConfig
from vllm_deltasync.server.engine.coordinator import Coordinator
from vllm_deltasync.server.engine.handle import Pause
from vllm_deltasync.server.messages import (
    ApplyAnswer,
    CommitAnswer,
    CommitOutcome,
    LastApply,
    Outcome,
    RankStatus,
    RevertAnswer,
    TargetStatus,
)


class FakeTarget:
    """One target's switch state on a fake rank."""

    def __init__(self, applied: int | None, ready: tuple[int, ...]) -> None:
        self.applied: int | None = applied
        self.weights: int | str | None = applied
        self.ready = list(ready)
        self.pending: tuple[int, int | None] | None = None
        self.attempted: int | None = None
        self.dirty = False


class FakeRank:
    """A rank answering the ``deltasync_*`` RPCs on the wire, per target (``model``)."""

    def __init__(self, rank: int, applied: int | None = 2, ready: tuple[int, ...] = (3,), *,
                 targets: tuple[str, ...] = ("policy",)) -> None:
        self.rank = rank
        self.targets = {name: FakeTarget(applied, ready) for name in targets}
        self.fail: dict[str, Callable[[], Any]] = {}

    # the policy's state, for the tests that follow only the policy
    def __getattr__(self, name: str) -> Any:
        if name in ("applied", "weights", "ready", "pending", "dirty"):
            return getattr(self.__dict__["targets"]["policy"], name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("applied", "weights", "ready", "pending", "dirty"):
            setattr(self.targets["policy"], name, value)
        else:
            super().__setattr__(name, value)

    @staticmethod
    def ids(step: int | None) -> str | None:
        return None if step is None else f"sha256:{step}"

    def status_of(self, name: str) -> TargetStatus:
        t = self.targets[name]
        return TargetStatus(rank=self.rank, model=name, applied_step=t.applied,
                            applied_id=self.ids(t.applied), ready_steps=tuple(t.ready),
                            ready_ids=tuple(self.ids(s) for s in t.ready),
                            pending_switch=t.pending[0] if t.pending else None,
                            newest_step=max(t.ready, default=t.applied))

    def deltasync_status(self) -> dict[str, Any]:
        return RankStatus({n: self.status_of(n) for n in self.targets}, "policy").to_wire()

    def deltasync_apply(self, step: int, identity: str | None = None,
                        model: str = "policy") -> dict[str, Any]:
        t = self.targets[model]
        assert step in t.ready and identity == self.ids(step), (step, identity, t.ready)
        t.attempted = step
        chain = [s for s in t.ready if s <= step]
        t.pending = (step, t.applied)
        t.applied = t.weights = step
        t.ready = [s for s in t.ready if s > step]
        done = LastApply(step=step, steps=tuple(chain), kinds=("delta",) * len(chain),
                         apply_s=0.001, repacked_layers=0, repack_s=0.0, written=1,
                         downloaded_bytes=1, staged_bytes=1, changed=1, numel=1,
                         published_at=None, at=0.0)
        return ApplyAnswer(self.rank, Outcome.APPLIED, done=done).to_wire()

    def deltasync_commit(self, step: int, model: str = "policy") -> dict[str, Any]:
        t = self.targets[model]
        if t.pending is None or t.pending[0] != step:
            return CommitAnswer(self.rank, CommitOutcome.NOT_PENDING).to_wire()
        t.pending = None
        return CommitAnswer(self.rank, CommitOutcome.COMMITTED).to_wire()

    def deltasync_revert(self, step: int, reason: str, model: str = "policy") -> dict[str, Any]:
        t = self.targets[model]
        if t.dirty:
            outcome = Outcome.UNKNOWN
        elif t.pending is not None and t.pending[0] == step:
            t.applied = t.weights = t.pending[1]
            t.pending, t.ready = None, []
            outcome = Outcome.PUT_BACK
        elif t.attempted != step and t.weights == t.applied:
            t.ready = []
            outcome = Outcome.NOTHING_WRITTEN
        else:
            outcome = Outcome.UNKNOWN
        if outcome is Outcome.UNKNOWN:
            self.deltasync_reset(reason, model)
        return RevertAnswer(self.rank, outcome).to_wire()

    def deltasync_reset(self, reason: str, model: str = "policy") -> None:
        t = self.targets[model]
        t.applied, t.pending, t.ready, t.dirty = None, None, [], False


class FakeEngine:
    """An engine core as the coordinator drives it (``server/engine/handle.py`` ``EngineCore``):
    a stand-in of vLLM's, whose ``collective_rpc`` reaches the fake ranks."""

    def __init__(self, ranks: list[FakeRank]) -> None:
        self.ranks = ranks
        self.paused: Pause = "none"
        self.lora_ids: set[int] = set()
        """The LoRA adapter ids the unfinished requests use."""
        self.unfinished = False
        self.version = "2"
        self.calls: list[str] = []
        self.prefix_resets = 0
        self.broadcast_fail: dict[str, BaseException] = {}
        """method -> raised after every rank ran it (a timeout that came late)."""
        self.fail_version = False
        """The next ``set_weight_version`` raises (the engine core's part of a switch fails)."""

    def collective_rpc(self, method: str, timeout: float | None = None, args: Sequence[Any] = (),
                       kwargs: Mapping[str, Any] | None = None) -> list[Any]:
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
        if self.fail_version:
            self.fail_version = False
            raise RuntimeError("set_weight_version failed")
        self.version = version

    def get_weight_version(self) -> str:
        return self.version

    def pause(self) -> Pause:
        return self.paused

    def set_pause(self, state: Pause) -> None:
        self.paused = state

    def has_unfinished_requests(self) -> bool:
        return self.unfinished

    def lora_ids_in_use(self) -> set[int]:
        return set(self.lora_ids)


def once(exc: BaseException) -> Callable[[], None]:
    """A failure injected once (the next call goes through)."""
    fired: list[bool] = []

    def fail() -> None:
        if not fired:
            fired.append(True)
            raise exc

    return fail


def make_coordinator(ranks: list[FakeRank], *, trainer_driven: bool = False,
                     requests: Any = None, **config: Any) -> tuple[Coordinator, FakeEngine]:
    """``requests``: a :class:`FakeScheduler` the coordinator salts (None: nothing salted)."""
    engine = FakeEngine(ranks)
    coord = Coordinator(engine, SyncConfig(url="file:///tmp/bucket", metrics_port=0, **config),
                        wake=None, trainer_driven=trainer_driven, requests=requests)
    coord.active = True
    return coord, engine


class FakeRequest:
    """A stand-in of vLLM's ``Request`` as ``server/engine/kv.py`` sees it."""

    def __init__(self, rid: str, state: str, salt: str | None, adapter: str | None) -> None:
        self.rid, self.state, self.salt, self.adapter = rid, state, salt, adapter
        self.computed = 0


class FakeScheduler:
    """A stand-in of vLLM's scheduler through the ``Requests`` protocol of
    ``server/engine/kv.py`` (``server/vllm/scheduler.py`` is the real one): requests by id in
    admission order, a running one preempted becomes idle."""

    def __init__(self) -> None:
        self.requests: dict[str, FakeRequest] = {}
        self.preempted: list[str] = []
        self.rehashed: list[str] = []

    @staticmethod
    def make(rid: str, state: str, salt: str | None, adapter: str | None) -> FakeRequest:
        return FakeRequest(rid, state, salt, adapter)

    def add(self, rid: str, state: str, salt: str | None, adapter: str | None) -> FakeRequest:
        self.requests[rid] = self.make(rid, state, salt, adapter)
        return self.requests[rid]

    def unfinished(self) -> list[Any]:
        return list(self.requests.values())

    def state(self, request: FakeRequest) -> str:
        return request.state

    def salt(self, request: FakeRequest) -> str | None:
        return request.salt

    def adapter(self, request: FakeRequest) -> str | None:
        return request.adapter

    def resalt(self, request: FakeRequest, salt: str | None) -> None:
        request.salt = salt
        self.rehashed.append(request.rid)

    def preempt(self, requests: Any) -> int:
        for r in requests:
            assert r.state == "running", r.rid
            r.state = "idle"
            self.preempted.append(r.rid)
        return sum(r.computed for r in requests)

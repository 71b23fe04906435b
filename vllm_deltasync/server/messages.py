"""What the worker ranks and the engine core say to each other, written down once.

The engine core reaches the ranks only through ``collective_rpc``. Every answer is a frozen
dataclass here, built by the rank and turned into a plain dict (:meth:`to_wire`) only to cross
the RPC, and parsed back (:meth:`from_wire`) once, where it arrives: the coordinator, the
metrics and ``/synced`` read attributes, never ``.get`` with a default. The wire form is what
users see too (``LLM.collective_rpc("deltasync_status")`` returns the dicts; docs/extension.md),
so its keys stay stable. A dict with a key this release does not know, or without one it
writes, is a :class:`MessageError` naming the message and the key: ranks and engine core run
the same release, and a half-understood status is never acted on.

- :class:`TargetStatus` one rank's view of one followed target (``server/targets.py``);
  :class:`RankStatus` the policy's status at the top level and each other target's under its
  name (``status["drafter"]``).
- :class:`ApplyAnswer`, :class:`RevertAnswer`, :class:`CommitAnswer`: the switch RPCs, with
  :class:`Outcome` saying what the weights of that rank are after the call.
- :class:`LastApply`: what one switch did on one rank; :class:`Counters`: the rank's
  cumulative counters (the metrics turn them into increments).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from vllm_deltasync.errors import DeltaSyncError


class MessageError(DeltaSyncError):
    """A message between the ranks and the engine core is not what this release writes."""


class Outcome(enum.StrEnum):
    """What a rank's weights of one target are after a switch RPC."""

    APPLIED = "applied"
    """Every staged step up to the switch's step is written; the undo is kept until commit."""
    NOTHING_WRITTEN = "nothing_written"
    """The rank never wrote the step: its weights are what they were before the switch."""
    PUT_BACK = "put_back"
    """The rank wrote (part of) the step and put every element back, bit for bit."""
    UNKNOWN = "unknown"
    """The weights may be half written: the rank forgot its step (it resyncs through an
    anchor) and the engine core must not serve a forward mixing them (``holds_engine``)."""

    @property
    def as_before(self) -> bool:
        """The rank holds its weights from before the switch."""
        return self in (Outcome.NOTHING_WRITTEN, Outcome.PUT_BACK)


class CommitOutcome(enum.StrEnum):
    COMMITTED = "committed"
    """The switch was pending here; its undo is dropped."""
    NOT_PENDING = "not_pending"
    """No pending switch to that step (already committed: the commit is idempotent)."""
    FAILED = "failed"
    """The commit raised on this rank (logged); the switch stays pending."""


M = TypeVar("M")


def _parse(cls: type[M], wire: Any, what: str, **convert: Any) -> M:
    """``cls`` from its wire dict: every field present, no other key (module doc)."""
    if not isinstance(wire, Mapping):
        raise MessageError(f"{what}: expected a dict, got {type(wire).__name__}")
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    missing = [n for n in names if n not in wire]
    unknown = sorted(set(wire) - set(names))
    if missing or unknown:
        raise MessageError(f"{what}: missing keys {missing}, unknown keys {unknown}; the ranks "
                           "and the engine core must run the same vllm-deltasync release")
    values = {n: (convert[n](wire[n]) if n in convert and wire[n] is not None else wire[n])
              for n in names}
    return cls(**values)


@dataclass(frozen=True)
class LastApply:
    """What one switch did on one rank (``TargetRank.apply``; kept as ``last_apply``)."""

    step: int
    steps: tuple[int, ...]
    """Every step applied, in order (a chain of deltas, or an anchor and deltas)."""
    kinds: tuple[str, ...]
    apply_s: float
    repacked_layers: int
    repack_s: float
    written: int
    """Elements written in place."""
    downloaded_bytes: int
    staged_bytes: int
    changed: int
    numel: int
    published_at: float | None
    at: float

    def to_wire(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["steps"], out["kinds"] = list(self.steps), list(self.kinds)
        return out

    @classmethod
    def from_wire(cls, wire: Any) -> LastApply:
        return _parse(cls, wire, "last_apply", steps=tuple, kinds=tuple)


@dataclass(frozen=True)
class Counters:
    """A rank's cumulative counters of one target (``metrics.WorkerStats.snapshot``)."""

    epoch: str
    """Changes when the worker restarts (the metrics start counting again)."""
    downloaded_bytes: Mapping[str, int]
    applied_steps: Mapping[str, int]
    changed_elements: int
    branch_changes: int
    failures: tuple[tuple[str, str, int], ...]
    """(stage, reason, count)."""
    events: tuple[tuple[int, str, float], ...]
    """(sequence, "download" | "apply", seconds): durations, each counted once."""
    store_requests: tuple[tuple[str, str, int], ...]
    """(operation, outcome, count)."""
    store_bytes_read: int
    mirror_requests: tuple[tuple[str, str, int], ...] = ()
    """(mirror URL, outcome, count): data reads tried on a mirror (``stores/mirrors.py``)."""

    def to_wire(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "downloaded_bytes": dict(self.downloaded_bytes),
                "applied_steps": dict(self.applied_steps),
                "changed_elements": self.changed_elements, "branch_changes": self.branch_changes,
                "failures": [list(f) for f in self.failures],
                "events": [list(e) for e in self.events],
                "store_requests": [list(r) for r in self.store_requests],
                "store_bytes_read": self.store_bytes_read,
                "mirror_requests": [list(r) for r in self.mirror_requests]}

    @classmethod
    def from_wire(cls, wire: Any) -> Counters:
        rows = lambda items: tuple(tuple(i) for i in items)  # noqa: E731
        return _parse(cls, wire, "counters", downloaded_bytes=dict, applied_steps=dict,
                      failures=rows, events=rows, store_requests=rows, mirror_requests=rows)


@dataclass(frozen=True)
class TargetStatus:
    """One rank's view of one followed target (the answer of ``deltasync_status`` and of the
    start RPCs). Reading it changed nothing on the rank."""

    rank: int
    model: str
    """The target's name (``server/targets.py``), its ``model`` label in the metrics."""
    applied_step: int | None = None
    applied_id: str | None = None
    """The manifest identity of the applied step (docs/format.md §9.1)."""
    staged_step: int | None = None
    ready_steps: tuple[int, ...] = ()
    """Steps staged and fully prepared, in apply order."""
    ready_ids: tuple[str | None, ...] = ()
    branch_lost: str | None = None
    newest_step: int | None = None
    applied_published_at: float | None = None
    newest_published_at: float | None = None
    last_discovery_at: float | None = None
    staged_bytes: int = 0
    last_error: str | None = None
    pending_switch: int | None = None
    """A switch applied on this rank and not committed yet."""
    last_apply: LastApply | None = None
    bucket: str = ""
    staging_cpus: str = "none"
    """The cores this rank's staging threads run on (``"1"``, ``"4-7"``); ``"none"`` where
    affinity is not known."""
    counters: Counters | None = None
    fingerprint: str | None = None
    model_steps: int = 0
    pid: int = 0
    refused: str | None = None
    """Why this rank does not follow the target (its proof failed, the plugin or the surface
    refused, no such model on this engine)."""
    following: bool = False
    reloads: int = 0
    cpu_kernels: Any = "inplace"
    """``"inplace"`` or the packed layers' report (for people; the engine core never reads it)."""
    proof: Mapping[str, Any] | None = None
    """The startup proof's report (for people)."""
    layout_bytes: int = 0
    proof_classes: tuple[str, ...] = ()
    """The parameter classes of check 2 of the proof (the start answer only)."""
    versions: tuple[tuple[int, int, str | None], ...] = ()
    """A target whose steps are versions kept side by side (a LoRA adapter): ``(step,
    adapter id, manifest identity)`` of every version registered on this rank, oldest first
    (``server/worker/adapters.py``); empty for every other target."""

    def ready_pairs(self) -> list[tuple[int, str | None]]:
        """(step, identity) of each ready step."""
        return list(zip(self.ready_steps, self.ready_ids, strict=True))

    @property
    def applied(self) -> tuple[int | None, str | None]:
        return self.applied_step, self.applied_id

    def to_wire(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["ready_steps"], out["ready_ids"] = list(self.ready_steps), list(self.ready_ids)
        out["proof_classes"] = list(self.proof_classes)
        out["versions"] = [list(v) for v in self.versions]
        out["last_apply"] = None if self.last_apply is None else self.last_apply.to_wire()
        out["counters"] = None if self.counters is None else self.counters.to_wire()
        out["proof"] = None if self.proof is None else dict(self.proof)
        return out

    @classmethod
    def from_wire(cls, wire: Any, what: str = "deltasync_status") -> TargetStatus:
        status = _parse(cls, wire, what, ready_steps=tuple, ready_ids=tuple,
                        proof_classes=tuple, last_apply=LastApply.from_wire,
                        counters=Counters.from_wire, versions=_versions)
        if len(status.ready_steps) != len(status.ready_ids):
            raise MessageError(f"{what}: ready_steps and ready_ids differ in length")
        return status


def _versions(raw: Any) -> tuple[tuple[int, int, str | None], ...]:
    out = []
    for v in raw:
        if (not isinstance(v, (list, tuple)) or len(v) != 3 or not isinstance(v[0], int)
                or not isinstance(v[1], int) or not (v[2] is None or isinstance(v[2], str))):
            raise MessageError(f"deltasync_status: versions entry {str(v)[:80]} is not "
                               "[step, adapter id, identity]")
        out.append((v[0], v[1], v[2]))
    return tuple(out)


@dataclass(frozen=True)
class RankStatus:
    """One rank's whole answer: the policy's status at the top level of the wire dict, each
    other followed target's under its name (``{"rank": 0, ..., "drafter": {...}}``)."""

    targets: Mapping[str, TargetStatus]
    """By target name, the primary's always present."""
    primary: str
    """The target whose status is the top level of the wire dict (the policy)."""

    @property
    def rank(self) -> int:
        return self.targets[self.primary].rank

    def of(self, name: str) -> TargetStatus | None:
        return self.targets.get(name)

    def to_wire(self) -> dict[str, Any]:
        out = self.targets[self.primary].to_wire()
        for name, status in self.targets.items():
            if name != self.primary:
                out[name] = status.to_wire()
        return out

    @classmethod
    def from_wire(cls, wire: Any, *, primary: str, others: Sequence[str]) -> RankStatus:
        """``others``: the names a rank may carry beside the primary target's fields."""
        if not isinstance(wire, Mapping):
            raise MessageError(f"deltasync_status: expected a dict, got {type(wire).__name__}")
        nested = {k: wire[k] for k in others if k in wire}
        top = {k: v for k, v in wire.items() if k not in nested}
        targets = {primary: TargetStatus.from_wire(top)}
        for name, value in nested.items():
            targets[name] = TargetStatus.from_wire(value, f"deltasync_status[{name!r}]")
        return cls(targets, primary)


@dataclass(frozen=True)
class ApplyAnswer:
    """The answer of ``deltasync_apply``: what the rank's weights of the target are now."""

    rank: int
    outcome: Outcome
    error: str | None = None
    done: LastApply | None = None
    """What was applied (``APPLIED`` only)."""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.APPLIED

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "outcome": self.outcome.value, "ok": self.ok,
                "error": self.error, "done": None if self.done is None else self.done.to_wire()}

    @classmethod
    def from_wire(cls, wire: Any) -> ApplyAnswer:
        if not isinstance(wire, Mapping):
            raise MessageError(f"deltasync_apply: expected a dict, got {type(wire).__name__}")
        body = {k: v for k, v in wire.items() if k != "ok"}
        answer = _parse(cls, body, "deltasync_apply", outcome=Outcome,
                        done=LastApply.from_wire)
        if wire.get("ok") is not answer.ok or (answer.ok and answer.done is None):
            raise MessageError("deltasync_apply: 'ok' and 'outcome' disagree")
        return answer


@dataclass(frozen=True)
class RevertAnswer:
    """The answer of ``deltasync_revert``."""

    rank: int
    outcome: Outcome
    """``PUT_BACK`` or ``NOTHING_WRITTEN`` (the weights are as before the switch), else
    ``UNKNOWN`` (the rank forgot its step)."""

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "outcome": self.outcome.value}

    @classmethod
    def from_wire(cls, wire: Any) -> RevertAnswer:
        answer = _parse(cls, wire, "deltasync_revert", outcome=Outcome)
        if answer.outcome is Outcome.APPLIED:
            raise MessageError("deltasync_revert: a revert never answers 'applied'")
        return answer


@dataclass(frozen=True)
class CommitAnswer:
    """The answer of ``deltasync_commit``."""

    rank: int
    outcome: CommitOutcome

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "outcome": self.outcome.value}

    @classmethod
    def from_wire(cls, wire: Any) -> CommitAnswer:
        return _parse(cls, wire, "deltasync_commit", outcome=CommitOutcome)


@dataclass(frozen=True)
class SwitchRecord:
    """One switch as the engine status lists it."""

    model: str
    step: int
    identity: str | None
    pause_s: float
    at: float
    steps: tuple[int, ...] = ()
    kinds: tuple[str, ...] = ()
    apply_s: tuple[float, ...] = ()
    repack_s: tuple[float, ...] = ()
    downloaded_bytes: tuple[int, ...] = ()
    changed: int = 0
    numel: int = 0
    in_flight: str | None = None
    """What its running requests did (``in_flight``); None: it determines nobody's KV."""
    kept: int = 0
    """Running requests that continued from their KV (``server/engine/kv.py`` ``KvSwitch``)."""
    recomputed: int = 0
    """Running requests preempted to compute their KV again on the new weights."""
    recompute_tokens: int = 0
    """The KV tokens those had computed."""
    resalted: int = 0
    """Requests given the new weights' prefix-cache salt at the switch."""

    def to_wire(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("steps", "kinds", "apply_s", "repack_s", "downloaded_bytes"):
            out[key] = list(out[key])
        return out


@dataclass(frozen=True)
class TargetReport:
    """The engine core's view of one target (``deltasync_engine_status``)."""

    switches: tuple[SwitchRecord, ...] = ()
    failures: int = 0
    last_error: str | None = None
    max_wait_ticks: int = 0
    """The longest a step staged on every rank waited for its switch, in ticks (the bound:
    ``server/engine/follower.py`` ``SWITCH_BOUND_TICKS``)."""
    ticks: int = 0
    held: str | None = None
    """Why this target's ranks resync through an anchor (the policy's hold stops scheduling)."""
    holds: tuple[Mapping[str, Any], ...] = ()
    ranks: tuple[Mapping[str, Any], ...] = ()
    versions: tuple[tuple[int, int], ...] = ()
    """A target whose steps are versions kept side by side: (step, adapter id) of each version
    requests may use now (``server/engine/versions.py``)."""

    def to_wire(self) -> dict[str, Any]:
        return {"versions": [list(v) for v in self.versions],
                "switches": [s.to_wire() for s in self.switches], "failures": self.failures,
                "last_error": self.last_error, "max_wait_ticks": self.max_wait_ticks,
                "ticks": self.ticks, "held": self.held,
                "holds": [dict(h) for h in self.holds], "ranks": [dict(r) for r in self.ranks]}


@dataclass(frozen=True)
class EngineStatus:
    """``call_utility("deltasync_engine_status")``: the coordinator's view. The wire dict has
    the policy's report at the top level (``switches``, ``held``, ...) and each other
    target's under its name (``"drafter"``: None when that target is not followed)."""

    active: bool
    weight_version: str | None
    last_error: str | None
    failed_ticks: int
    failing: bool
    reloads: int
    metrics_port: int | None
    targets: Mapping[str, TargetReport]
    primary: str

    def to_wire(self, names: Sequence[str] = ()) -> dict[str, Any]:
        primary = self.targets.get(self.primary, TargetReport())
        out: dict[str, Any] = {"active": self.active, "weight_version": self.weight_version,
                               "last_error": self.last_error, "failed_ticks": self.failed_ticks,
                               "failing": self.failing, "reloads": self.reloads,
                               "metrics_port": self.metrics_port, **primary.to_wire()}
        out["last_error"] = self.last_error
        for name in names:
            if name != self.primary:
                report = self.targets.get(name)
                out[name] = None if report is None else report.to_wire()
        return out


def inactive_status() -> dict[str, Any]:
    """The engine status of an engine core without a coordinator."""
    return {"active": False}


__all__ = ["ApplyAnswer", "CommitAnswer", "CommitOutcome", "Counters", "EngineStatus",
           "LastApply", "MessageError", "Outcome", "RankStatus", "RevertAnswer", "SwitchRecord",
           "TargetReport", "TargetStatus", "inactive_status"]

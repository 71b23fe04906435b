"""What the worker ranks and the engine core say to each other, written down once.

The engine core's coordinator reaches the ranks only through ``collective_rpc``; these are the
shapes of the answers, used on both sides (the rank builds them, the coordinator, the metrics
and ``/synced`` read them). They are ``TypedDict`` s, not dataclasses, on purpose: they cross
vLLM's RPC (pickled), are served as JSON by ``/synced`` and ``vllm-deltasync status``, and users
read them from ``LLM.collective_rpc("deltasync_status")`` as dicts (docs/extension.md), so the
wire shape stays a plain dict while mypy checks every key on both sides. Every key is optional
(``total=False``): a rank that refused answers only a few, and an answer from a rank of an
older release may lack newer keys; readers use ``.get``.
"""

from __future__ import annotations

from typing import Any, TypedDict


class LastApply(TypedDict, total=False):
    """What one switch did on one rank (``RankState.apply``; kept as ``last_apply``)."""

    step: int
    steps: list[int]
    """Every step applied, in order (a chain of deltas, or an anchor and deltas)."""
    kinds: list[str]
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


class ApplyResult(LastApply, total=False):
    """The answer of ``deltasync_apply``: ``ok`` with what was done, or the error and whether
    this rank put its weights back (``reverted``)."""

    ok: bool
    rank: int
    error: str
    reverted: bool


class RankStatus(TypedDict, total=False):
    """The answer of ``deltasync_status`` (and of ``deltasync_start`` / ``_prove`` /
    ``_follow`` / ``_stop``): one rank's view, read by the coordinator every tick."""

    rank: int
    applied_step: int | None
    applied_id: str | None
    """The manifest identity of the applied step (docs/format.md §9.1)."""
    staged_step: int | None
    ready_steps: list[int]
    """Steps staged and fully prepared, in apply order."""
    ready_ids: list[str | None]
    branch_lost: str | None
    newest_step: int | None
    applied_published_at: float | None
    newest_published_at: float | None
    last_discovery_at: float | None
    staged_bytes: int
    last_error: str | None
    pending_switch: int | None
    """A switch applied on this rank and not committed yet."""
    last_apply: LastApply | None
    bucket: str
    staging_cpus: str
    """The cores this rank's staging threads run on (``"1"``, ``"4-7"``; CPU build:
    ``SyncConfig.staging_cpus``), ``"none"`` where affinity is not known (not Linux)."""
    counters: dict[str, Any]
    fingerprint: str | None
    model_steps: int
    model: str
    """``policy``, or ``drafter`` (the speculative draft model, followed from its own bucket)."""
    drafter: RankStatus | None
    """The policy's answer carries the drafter's status on this rank (``model="drafter"``),
    when a drafter bucket is configured."""
    pid: int
    refused: str | None
    """Why this rank does not follow (its proof failed, the plugin or the surface refused)."""
    following: bool
    reloads: int
    cpu_kernels: Any
    proof: dict[str, Any] | None
    layout_bytes: int
    proof_classes: list[str]


class EngineStatus(TypedDict, total=False):
    """``call_utility("deltasync_engine_status")``: the coordinator's view."""

    active: bool
    weight_version: str
    switches: list[dict[str, Any]]
    last_error: str | None
    failed_ticks: int
    failing: bool
    held: str | None
    holds: list[dict[str, Any]]
    reloads: int
    ranks: list[dict[str, Any]]
    metrics_port: int | None
    drafter: dict[str, Any] | None
    """The speculative drafter's switches and ranks (``drafter_url``), or None."""


__all__ = ["ApplyResult", "EngineStatus", "LastApply", "RankStatus"]

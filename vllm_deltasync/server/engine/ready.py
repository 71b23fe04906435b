"""Which step every rank can switch a target to, from the ranks' statuses.

A switch applies, on each rank, every step it staged up to the chosen one. Ranks plan their
chains by themselves (their pollers discover at different moments, and one may reach a step
through an anchor where another went through deltas), so the lists of staged steps need not
be equal: what must be equal is where every rank starts (the same applied step *and* manifest
identity, or every rank knowing nothing after a reset) and where it ends (the same step and
identity, staged on every rank). Each rank's chain ends on exactly that manifest (its chain
was checked by identity, docs/format.md §9), so every rank ends on the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_deltasync.server.messages import TargetStatus

Pair = tuple[int, "str | None"]


def common_ready(statuses: Sequence[TargetStatus]) -> Pair | None:
    """The newest (step, identity) every rank has staged, every rank on the same applied step
    and identity; None when there is none."""
    common = _common_pairs(statuses)
    return max(common, key=lambda pair: pair[0]) if common else None


def staged_target(statuses: Sequence[TargetStatus], step: int,
                  identity: str | None) -> Pair | None:
    """(step, identity as the ranks report it) when every rank has ``step`` staged on top of
    the same applied step, or None. ``identity`` (the trainer's manifest identity), where both
    it and the ranks name one, must be the ranks' (a delta never applies onto other weights)."""
    for found, found_id in _common_pairs(statuses):
        if found == step and (identity is None or found_id is None or found_id == identity):
            return found, found_id
    return None


def one_applied(statuses: Sequence[TargetStatus]) -> bool:
    """Every rank on the same applied step and identity (or every rank on none)."""
    return bool(statuses) and len({s.applied for s in statuses}) == 1


def _common_pairs(statuses: Sequence[TargetStatus]) -> set[Pair]:
    if not one_applied(statuses):
        return set()
    return set.intersection(*(set(s.ready_pairs()) for s in statuses))


__all__ = ["Pair", "common_ready", "one_applied", "staged_target"]

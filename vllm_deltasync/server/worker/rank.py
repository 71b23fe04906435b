"""One rank: every target it follows (``server/targets.py``), built and proved at start.

The extension keeps one :class:`Rank` per worker (``DeltaSyncExtension._deltasync``). It holds
a :class:`~.target.FollowedTarget` per followed target of the server's table
(``targets_for(config)``: a :class:`~.target.TargetRank` for parameters written in place, an
:class:`~.adapters.AdapterRank` for a LoRA adapter, by the row's ``writer``) and the refusals of
the targets that do not follow here. The first row of the target table is the *primary* target
(the policy): when it cannot follow, the rank refuses as a whole; any other target that cannot
follow is refused alone (its reason in its status) and the rest follow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import ConfigError, DeltaSyncError
from vllm_deltasync.format.manifest import fingerprint
from vllm_deltasync.server.messages import RankStatus
from vllm_deltasync.server.targets import TARGETS, Source, Target, targets_for
from vllm_deltasync.server.worker.checkpoint import ParamSet, checkpoint_params
from vllm_deltasync.server.worker.target import (
    FollowedTarget,
    TargetRank,
    bucket_params,
    refused_status,
)
from vllm_deltasync.server.worker.view import WorkerView

logger = logging.getLogger(__name__)

PRIMARY: Target = TARGETS[0]

Missing = Callable[[str], list[str]]
"""Why this vLLM cannot serve the following of a scope of targets (``Target.surface_scope``):
one line per missing vLLM symbol, naming the vLLM version (``server/vllm/surface.py``)."""


class Rank:
    """Every target one rank follows (module doc)."""

    def __init__(self, rank: int, targets: Mapping[str, FollowedTarget],
                 refusals: Mapping[str, str], rows: tuple[Target, ...] = TARGETS) -> None:
        self.rank = rank
        self.targets = dict(targets)
        self.refusals = dict(refusals)
        """Targets configured but refused on this rank, with the reason."""
        self.rows = rows
        """The server's target table (``targets_for(config)``)."""

    @property
    def primary(self) -> TargetRank:
        primary = self.targets[PRIMARY.name]
        assert isinstance(primary, TargetRank)
        return primary

    @classmethod
    def build(cls, view: WorkerView, config: SyncConfig, *, missing: Missing) -> Rank:
        """Build and (for the targets whose proof is their own) prove every configured target.
        Raises :class:`DeltaSyncError` when the primary target cannot follow."""
        rows = targets_for(config)
        sources = {row.name: src for row in rows if (src := row.source(config)) is not None}
        primary_params = checkpoint_params(view.model_path)
        _check_prefixes(primary_params, sources)
        whole = _shared_bucket(view, rows, sources, primary_params)
        base = fingerprint((n, shape, "bfloat16") for n, (shape, _) in primary_params.items())
        adapters = sum(1 for row in rows if row.writer == "adapter" and row.name in sources)
        targets: dict[str, FollowedTarget] = {}
        refusals: dict[str, str] = {}
        for row in rows:
            source = sources.get(row.name)
            if source is None:
                continue
            try:
                if row.writer == "adapter":
                    targets[row.name] = _build_adapter(view, row, source, missing, base,
                                                       adapters)
                else:
                    targets[row.name] = _build_target(view, row, source, whole, missing)
            except DeltaSyncError as exc:  # the startup proof's ProofFailed among them
                if row is PRIMARY:
                    raise
                refusals[row.name] = f"{type(exc).__name__}: {exc}"
                logger.error("deltasync rank %d: the %s does not follow: %s (the others do)",
                             view.rank, row.name, refusals[row.name])
        return cls(view.rank, targets, refusals, rows)

    def get(self, name: str) -> FollowedTarget:
        """The target ``name`` on this rank; a clear error when it does not follow here."""
        found = self.targets.get(name)
        if found is not None:
            return found
        from vllm_deltasync.server.targets import target

        row = target(name, self.rows)
        raise DeltaSyncError(f"{row.name} does not follow on rank {self.rank}: "
                             + self.refusals.get(name, "it is not configured on this server"))

    def status(self, *, with_classes: list[str] | None = None) -> RankStatus:
        """Every target's status (the refused ones with their reason)."""
        out = {name: t.status() for name, t in self.targets.items()}
        for name, reason in self.refusals.items():
            out[name] = refused_status(self.rank, name, reason)
        if with_classes is not None:
            import dataclasses

            out[PRIMARY.name] = dataclasses.replace(out[PRIMARY.name],
                                                    proof_classes=tuple(with_classes))
        return RankStatus(out, PRIMARY.name)

    def settle_writes(self) -> None:
        for t in self.targets.values():
            t.settle_writes()

    def follow(self) -> None:
        """Every rank passed the collective proof: start every target's poller."""
        for t in self.targets.values():
            t.follow()

    def stop(self, reason: str) -> None:
        """Some rank refused: no target follows on this one either."""
        for t in self.targets.values():
            if t.refused is None:
                t.refuse(reason)

    def close(self) -> None:
        for t in self.targets.values():
            t.close()

    def record_step(self, run: Callable[[], Any], num_tokens: int) -> Any:
        """One model step, traced with the primary target's version (``deltasync_trace``)."""
        return self.primary.record_step(run, num_tokens)


def refused(view_rank: int, reason: str) -> RankStatus:
    """The status of a rank whose primary target refused at start."""
    return RankStatus({PRIMARY.name: refused_status(view_rank, PRIMARY.name, reason)},
                      PRIMARY.name)


def _build_target(view: WorkerView, row: Target, source: Source, whole: ParamSet | None,
                  missing: Missing) -> TargetRank:
    lacks = missing(row.surface_scope)
    if lacks:
        raise DeltaSyncError(f"the {row.name} does not follow: {'; '.join(lacks)}")
    weights = row.weights(view)
    if weights is None:
        raise DeltaSyncError(row.missing)
    state = TargetRank(view, row, source, weights, bucket_params=whole)
    if not row.collective_proof:
        state.prove_alone()
        logger.info("deltasync rank %d %s proof passed", view.rank, row.name)
    return state


def _build_adapter(view: WorkerView, row: Target, source: Source, missing: Missing,
                   base_fingerprint: str, adapters: int) -> FollowedTarget:
    """A LoRA adapter's rank (``adapters.py``), or DeltaSyncError with the start refusal."""
    from vllm_deltasync.server.worker.adapters import AdapterRank, start_refusal

    lacks = missing(row.surface_scope)
    if lacks:
        raise DeltaSyncError(f"adapter {row.name!r} does not follow: {'; '.join(lacks)}")
    reason = start_refusal(row.name, view.lora, row.policy.versions_kept or 1, adapters)
    if reason is not None:
        raise DeltaSyncError(reason)
    return AdapterRank(view, row, source, base_fingerprint=base_fingerprint)


def _check_prefixes(primary: ParamSet, sources: Mapping[str, Source]) -> None:
    """A target reading its tensors from the primary's bucket under a prefix: no tensor of
    the primary's checkpoint may start with that prefix, else the primary would skip its own
    tensors and report steps applied that it never wrote (red team S1)."""
    for name, source in sources.items():
        if not source.prefix:
            continue
        clash = sorted(n for n in primary if n.startswith(source.prefix))
        if clash:
            raise ConfigError(
                f"the {name}'s tensor prefix {source.prefix!r} (drafter_prefix / "
                f"VLLM_DELTASYNC_DRAFTER_PREFIX) matches {len(clash)} tensor(s) of the "
                f"{PRIMARY.name}'s own checkpoint (e.g. {clash[0]!r}); publish the draft's "
                "tensors under a prefix no policy tensor starts with, such as 'eagle.'")


def _shared_bucket(view: WorkerView, rows: tuple[Target, ...], sources: Mapping[str, Source],
                   primary: ParamSet) -> ParamSet | None:
    """The parameter set of the primary's bucket when other targets' tensors are published
    in it under their prefixes, or None (no such target, or the engine runs no model to read
    one of them from: then unchecked)."""
    prefixed = {name: s.prefix for name, s in sources.items() if s.prefix}
    if not prefixed:
        return None
    others: dict[str, ParamSet] = {}
    for name, prefix in prefixed.items():
        weights = next(t for t in rows if t.name == name).weights(view)
        if weights is None:
            return None
        others[prefix] = checkpoint_params(weights[1])
    return bucket_params(primary, others)


__all__ = ["PRIMARY", "Rank", "refused"]

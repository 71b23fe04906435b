"""What a server keeps in sync: the followed targets, one row each.

A *target* is one set of weights the server follows from a bucket: the policy, the speculative
drafter, and next LoRA adapters or FP8 weights. Everything that differs between them is a row
of :data:`TARGETS`; the machinery that follows them is one and the same (the rank's
``TargetRank`` in ``server/worker/target.py``, the engine core's ``TargetFollower`` and ``Switch``
in ``server/engine/``) and never asks which target it has. A row says:

- where its steps come from (:meth:`Target.source`: a bucket URL, and which tensor names of it
  are this target's, under which name in its checkpoint);
- which model object it writes (:meth:`Target.weights`, from the rank's typed view of the
  worker) and whether the kernels' after-load layouts are learned for it;
- how its startup proof runs (one collective forward through the runner, or each rank's own
  modules);
- its switch policy (:class:`SwitchPolicy`): whether an unknown state holds the engine or only
  the target, whose KV cache its weights determine (the prefix-cache salt), whether a switch
  sets vLLM's weight version, whether it waits for a drain, whether the trainer drives it,
  whether its steps are versions kept side by side (LoRA adapters);
- how a rank writes it (:attr:`Target.writer`): parameters written in place, or adapter
  versions handed to vLLM's LoRA manager.

A target's ``name`` is its label everywhere: the ``model`` label of the metrics, the ``model``
argument of the ``deltasync_*`` RPCs, its key in a rank's status and in the engine status.
Those names appear here and nowhere else in the package.

Where a new target plugs in (docs/architecture.md, "Targets"): a row here with its source, its
weights and its policy; a writer in ``server/worker/`` if its weights are not plain parameters
written in place (LoRA adapters live in vLLM's LoRA manager: ``server/worker/adapters.py``).
Nothing else changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_deltasync.config import SyncConfig

if TYPE_CHECKING:
    import torch

    from vllm_deltasync.server.worker.view import WorkerView


@dataclass(frozen=True)
class SwitchPolicy:
    """How the engine core switches a target (``server/engine/``)."""

    holds_engine: bool
    """When its ranks cannot say which weights they hold (a failed switch some rank could not
    put back), no batch runs until every rank applied an anchor (the policy: a forward on
    mixed weights would be wrong). False: only this target resyncs through an anchor while the
    engine serves (the drafter: speculative decoding's output is the target model's whatever
    the draft)."""
    resets_prefix_cache: bool
    """A failed switch (taken back, or the weights unknown until an anchor) drops the prefix
    cache with the running requests, if the server's ``reset_prefix_cache`` allows. A switch
    that stands drops nothing: :attr:`kv_scope` keeps requests off other versions' blocks."""
    labels_version: bool
    """A switch sets vLLM's weight version to the step (``weight_versions`` spans, headers)."""
    drains: bool
    """With ``in_flight="drain"`` a switch waits for running requests."""
    trainer_driven: bool
    """Under the weight-transfer backend ``deltasync`` only the trainer's ``update_weights``
    switches it (ticks only release a hold)."""
    kv_scope: str = "every"
    """Whose KV cache its weights determine (``server/engine/kv.py``). ``"every"``: every
    request's (the policy): its applied identity salts every request's prefix-cache blocks,
    and ``in_flight`` says what running requests do at its switch. ``"none"``: nobody's (the
    drafter: the target model's KV depends only on the target's weights, a draft's KV from
    older draft weights only lowers acceptance; a LoRA adapter: each version is a vLLM adapter
    of its own name, which vLLM's block hashes cover)."""
    versions_kept: int | None = None
    """None: a step replaces the weights in place. A number: each step is a new version kept
    beside the older ones (a LoRA adapter: each its own vLLM adapter id and name, so a
    request keeps the version it started on and the prefix cache never mixes them); at most
    this many per target, an older one removed only when no request uses it
    (``server/engine/versions.py``)."""


@dataclass(frozen=True)
class Source:
    """Where a target's steps come from."""

    config: SyncConfig
    """The settings its rank state runs with (its bucket URL among them)."""
    prefix: str = ""
    """Only the bucket's tensors named ``prefix + name`` are this target's, ``name`` being the
    checkpoint name (empty: every tensor not claimed by another target's prefix)."""
    exclude: str = ""
    """Tensors whose names start with this belong to another target and are skipped."""

    def owns(self, bucket_name: str) -> bool:
        if self.prefix:
            return bucket_name.startswith(self.prefix)
        return not (self.exclude and bucket_name.startswith(self.exclude))

    def checkpoint_name(self, bucket_name: str) -> str:
        return bucket_name[len(self.prefix):]


Weights = tuple["torch.nn.Module", str]
"""The model object a target writes and the directory of the checkpoint it was loaded from."""


@dataclass(frozen=True)
class Target:
    """One followed target (module doc)."""

    name: str
    policy: SwitchPolicy
    source: Callable[[SyncConfig], Source | None]
    """Its source under the server's settings, None when this server does not follow it."""
    weights: Callable[[WorkerView], Weights | None]
    """The model it writes on this rank, None when the engine runs no such model."""
    missing: str
    """Why :attr:`weights` found none (the refusal line, with the fix)."""
    learns_layouts: bool
    """Its parameters may be rearranged by kernels after loading (MoE experts): learned at start."""
    collective_proof: bool
    """Check 2 of its startup proof is one forward of the whole engine (every rank at once,
    ``deltasync_prove``); False: each rank checks through its own modules at start."""
    surface_scope: str
    """The rows of the vLLM surface its following relies on (``server/vllm/surface.py``)."""
    writer: str = "params"
    """How a rank writes its steps: ``params`` (parameters written in place: ``TargetRank``,
    ``server/worker/target.py``) or ``adapter`` (a new LoRA adapter version in vLLM's LoRA
    manager per step: ``AdapterRank``, ``server/worker/adapters.py``)."""

    def describe(self) -> str:
        return self.name


def _policy_source(config: SyncConfig) -> Source:
    return Source(config, exclude=config.drafter_prefix)


def _drafter_source(config: SyncConfig) -> Source | None:
    if config.drafter_prefix:  # the draft's tensors in the policy's own bucket
        return Source(dataclasses.replace(config, loaded_step=None, node_cache="off"),
                      prefix=config.drafter_prefix)
    if config.drafter_url:
        return Source(dataclasses.replace(config, url=config.drafter_url, drafter_url="",
                                          loaded_step=None))
    return None


POLICY = Target(
    name="policy",
    policy=SwitchPolicy(holds_engine=True, resets_prefix_cache=True, labels_version=True,
                        drains=True, trainer_driven=True),
    source=_policy_source,
    weights=lambda view: (view.model, view.model_path),
    missing="the worker has no model",
    learns_layouts=True,
    collective_proof=True,
    surface_scope="engine",
)

DRAFTER = Target(
    name="drafter",
    policy=SwitchPolicy(holds_engine=False, resets_prefix_cache=False, labels_version=False,
                        drains=False, trainer_driven=False, kv_scope="none"),
    source=_drafter_source,
    weights=lambda view: view.drafter,
    missing=("drafter_url or drafter_prefix is set but this engine runs no draft model of its "
             "own (start it with speculative_config method 'draft_model' or 'eagle' and the "
             "draft's checkpoint)"),
    learns_layouts=False,
    collective_proof=False,
    surface_scope="drafter",
)

TARGETS: tuple[Target, ...] = (POLICY, DRAFTER)
"""The targets of every server, the policy first (it is built first on a rank: another
target's bucket may be checked against its checkpoint). A server's whole table is
:func:`targets_for` (these, then its adapters); the engine core switches them in
:func:`switch_order`."""

SWITCH_ORDER: tuple[Target, ...] = (DRAFTER, POLICY)
"""Within one tick: a target that never holds the engine first, so a policy switch that
holds cannot keep the others from switching in the same pause."""

LORA_SCOPE = "lora"
"""The surface scope of the adapter rows: a vLLM lacking a row of it refuses adapters only."""


def adapter_target(name: str, versions_kept: int) -> Target:
    """The row of LoRA adapter ``name`` of ``lora_urls``: its bucket, versions kept side by
    side (``versions_kept``), written as vLLM adapters from memory; it never holds the engine,
    resets no prefix cache (each version's adapter name is in vLLM's block hashes), sets no
    weight version and never drains."""
    def source(config: SyncConfig) -> Source | None:
        url = config.lora_urls.get(name)
        if url is None:
            return None
        return Source(dataclasses.replace(config, url=url, drafter_url="", drafter_prefix="",
                                          loaded_step=None, lora_urls={}))

    return Target(
        name=name,
        policy=SwitchPolicy(holds_engine=False, resets_prefix_cache=False, labels_version=False,
                            drains=False, trainer_driven=False, kv_scope="none",
                            versions_kept=versions_kept),
        source=source,
        weights=lambda view: None,  # no parameters of the model: vLLM's LoRA manager
        missing="",
        learns_layouts=False,
        collective_proof=False,
        surface_scope=LORA_SCOPE,
        writer="adapter",
    )


def targets_for(config: SyncConfig | None) -> tuple[Target, ...]:
    """The target table of a server with ``config``: :data:`TARGETS`, then one
    :func:`adapter_target` row per ``lora_urls`` entry, in the order given (None: no
    adapters). The names are checked by the config (``RESERVED_ADAPTER_NAMES``)."""
    if config is None or not config.lora_urls:
        return TARGETS
    return TARGETS + tuple(adapter_target(name, config.lora_versions_kept)
                           for name in config.lora_urls)


def switch_order(rows: tuple[Target, ...]) -> tuple[Target, ...]:
    """:data:`SWITCH_ORDER` with the other rows (adapters: they never hold) first."""
    return tuple(r for r in rows if r not in SWITCH_ORDER) + SWITCH_ORDER


def target(name: str, rows: tuple[Target, ...] = TARGETS) -> Target:
    """The row named ``name``; a clear error for any other name."""
    for row in rows:
        if row.name == name:
            return row
    from vllm_deltasync.errors import DeltaSyncError

    raise DeltaSyncError(f"model={name!r} is not a followed target; use one of "
                         f"{', '.join(repr(t.name) for t in rows)}")


def names(rows: tuple[Target, ...] = TARGETS) -> tuple[str, ...]:
    return tuple(t.name for t in rows)


ADAPTER_IDS = (1 << 30, (1 << 31) - 1)
"""The range of the vLLM adapter ids of followed versions (``lora_int_id``): above the ids
vLLM's own counter hands ``/v1/load_lora_adapter`` and ``--lora-modules`` (from 1 up), below
2**31."""


def adapter_id(name: str, step: int, identity: str | None) -> int:
    """The vLLM adapter id of version ``step`` (manifest ``identity``) of adapter ``name``: the
    same on every rank and every data-parallel engine (each computes it), another one for a
    step number a restarted trainer publishes again."""
    digest = hashlib.sha256(f"{name}\0{step}\0{identity or ''}".encode()).digest()
    lo, hi = ADAPTER_IDS
    return lo + int.from_bytes(digest[:8], "big") % (hi - lo)


__all__ = ["ADAPTER_IDS", "DRAFTER", "LORA_SCOPE", "POLICY", "SWITCH_ORDER", "TARGETS", "Source",
           "SwitchPolicy", "Target", "Weights", "adapter_id", "adapter_target", "names",
           "switch_order", "target", "targets_for"]

"""A followed LoRA adapter on one rank: each step a new adapter version, handed to vLLM's LoRA
manager from memory.

An adapter bucket (``DeltaPublisher(url, lora="adapter")``, docs/format.md §4.2) holds the
adapter's tensors under ``save_pretrained``'s names and, on every manifest, its ``adapter``
record (``format/adapter.py``). An adapter has no shard map over the model's parameters: every
rank stages the whole adapter (small) on the host, and vLLM's tensor-parallel LoRA layers slice
the full tensors for their rank themselves.

:class:`AdapterRank` is the adapter's :class:`~.target.FollowedTarget`, and its own
:class:`~.switching.Writer`:

- ``write`` rebuilds the full tensors of each step taken (the last applied version's tensors
  with the delta's patches, or the anchor's), ``finish`` registers the last one as a new vLLM
  adapter (:class:`AdapterSlots.add`: built from memory with vLLM's own checks, pinned in the
  CPU cache only: pinning in the GPU cache would take a slot), under the id
  :func:`~vllm_deltasync.server.targets.adapter_id` gives its name, step and identity. The
  older versions stay registered: a request keeps the version it started on;
- ``put_back`` removes the version just registered; a commit leaves nothing to drop;
- :meth:`AdapterRank.retire` removes older versions when the engine core asks
  (``server/engine/versions.py``: only versions no request uses, beyond
  ``lora_versions_kept``).

Refusals (one line naming the adapter and the fix; the server keeps serving the base model and
its other adapters): at start, vLLM without ``--enable-lora`` or with ``--max-cpu-loras`` below
``lora_versions_kept`` x adapters (:func:`start_refusal`); at the first step staged, an adapter
of a rank above ``--max-lora-rank``, of modules the model has no LoRA layer for, of another
base model, or that vLLM's own checks refuse (:func:`record_refusal`).

Threads: staging (``stage_patch``, ``prepare``) runs on the poller's staging thread; the rest
on the worker's main thread, between two model steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch

from vllm_deltasync.errors import ApplyError, DeltaSyncError
from vllm_deltasync.format.adapter import AdapterInfo
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.manifest import Manifest
from vllm_deltasync.format.reader import short_id
from vllm_deltasync.server.targets import Source, Target, adapter_id
from vllm_deltasync.server.worker.state import StagedStep
from vllm_deltasync.server.worker.target import FollowedTarget
from vllm_deltasync.server.worker.view import WorkerView

logger = logging.getLogger(__name__)

PREFIX = "base_model.model."
"""How ``save_pretrained`` names an adapter's tensors: ``base_model.model.<module>.lora_A.weight``."""


class AdapterSlots(Protocol):
    """vLLM's LoRA manager of one worker, as a followed adapter uses it (implemented by
    ``server/vllm/lora.py``; tests implement it on a plain dict)."""

    max_rank: int
    """``--max-lora-rank``."""
    capacity: int
    """``--max-cpu-loras``: adapters registered at once."""

    def modules(self) -> frozenset[str]:
        """The module names (last part) an adapter of this model may target."""

    def check(self, config: Mapping[str, Any]) -> str | None:
        """vLLM's own checks of an ``adapter_config.json`` object; why it is refused, or None."""

    def add(self, adapter: int, tensors: Mapping[str, torch.Tensor],
            config: Mapping[str, Any]) -> None:
        """Build adapter ``adapter`` from ``tensors`` (``save_pretrained``'s names) and
        ``config`` with vLLM's checks, register it and pin it in the CPU cache. Raises
        (nothing registered) when it cannot."""

    def remove(self, adapter: int) -> bool:
        """Unregister ``adapter``; False when it was not registered."""

    def ids(self) -> frozenset[int]:
        """Every adapter id registered now."""


@dataclasses.dataclass(frozen=True)
class Version:
    """One registered version of the adapter."""

    step: int
    adapter: int
    """vLLM's adapter id (``lora_int_id``)."""
    identity: str | None


@dataclasses.dataclass
class AdapterUndo:
    """What a switch of an adapter did: the tensors before it, the version it registered."""

    before: dict[str, torch.Tensor]
    tensors: dict[str, torch.Tensor] | None = None
    """The full tensors built so far (the last step written)."""
    manifest: Manifest | None = None
    registered: Version | None = None


def start_refusal(name: str, slots: AdapterSlots | None, kept: int, adapters: int) -> str | None:
    """Why adapter ``name`` cannot follow on this engine at all (checked at start): no LoRA
    manager, or too few CPU slots for ``kept`` versions of each of ``adapters`` adapters."""
    if slots is None:
        return (f"adapter {name!r}: this server runs without LoRA; start vLLM with "
                "--enable-lora (and --max-lora-rank at least the adapters' rank)")
    need = kept * adapters
    if slots.capacity < need:
        return (f"adapter {name!r}: --max-cpu-loras {slots.capacity} holds fewer than "
                f"lora_versions_kept x adapters = {kept} x {adapters} = {need} versions; start "
                f"vLLM with --max-cpu-loras {need} (or lower lora_versions_kept)")
    return None


def record_refusal(name: str, manifest: Manifest, slots: AdapterSlots,
                   base_fingerprint: str | None) -> str | None:
    """Why step ``manifest`` of adapter ``name`` cannot be served on this engine (module doc),
    or None."""
    info = manifest.adapter
    if info is None:
        return (f"adapter {name!r}: step {manifest.step} of its bucket carries no adapter "
                "record: it is not an adapter bucket; publish the adapter with "
                "DeltaPublisher(url, lora='adapter')")
    rank = max([info.rank, *_ranks(info)])
    if rank > slots.max_rank:
        return (f"adapter {name!r}: rank {rank} exceeds this server's --max-lora-rank "
                f"{slots.max_rank}; restart vLLM with --max-lora-rank {_rank_option(rank)} "
                f"(or publish a rank of at most {slots.max_rank})")
    modules = slots.modules()
    wrapped = sorted({m.rsplit(".", 1)[-1] for m in adapted_modules(manifest)})
    lacking = [m for m in wrapped if m not in modules]
    if lacking:
        return (f"adapter {name!r} targets modules {lacking} that this model has no LoRA layer "
                f"for (it has {sorted(modules)}); publish an adapter trained on this base "
                "model")
    if base_fingerprint is not None and info.base_fingerprint != base_fingerprint:
        return (f"adapter {name!r} was trained on another base model (its base fingerprint "
                f"{short_id(info.base_fingerprint)}, this server's model "
                f"{short_id(base_fingerprint)}); follow it on a server of its base model, or "
                "publish an adapter trained on this one")
    refused = slots.check(info.config)
    if refused is not None:
        return f"adapter {name!r}: vLLM refuses its configuration: {refused}"
    return None


def _ranks(info: AdapterInfo) -> list[int]:
    pattern = info.config.get("rank_pattern") or {}
    return [int(r) for r in pattern.values() if isinstance(r, int)] if isinstance(
        pattern, Mapping) else []


def _rank_option(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds ``rank``."""
    for choice in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if choice >= rank:
            return choice
    return rank


def adapted_modules(manifest: Manifest) -> set[str]:
    """The modules an adapter step's tensors adapt (``model.layers.0.self_attn.q_proj``)."""
    out = set()
    for entry in manifest.tensors:
        name = entry.name.removeprefix(PREFIX)
        for marker in (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B"):
            if marker in name:
                out.add(name.split(marker, 1)[0])
                break
    return out


class AdapterRank(FollowedTarget):
    """A LoRA adapter followed on one rank, and its writer (module doc)."""

    def __init__(self, view: WorkerView, target: Target, source: Source, *,
                 base_fingerprint: str | None) -> None:
        """``base_fingerprint``: the fingerprint of the served model's checkpoint, as an
        adapter record names its base (None: unchecked)."""
        super().__init__(view, target, source)
        slots = view.lora
        if slots is None:
            raise DeltaSyncError(start_refusal(self.name, None, 1, 1) or "")
        self.slots: AdapterSlots = slots
        self.base_fingerprint = base_fingerprint
        self.versions: list[Version] = []
        """Registered versions, oldest first."""
        self._tensors: dict[str, torch.Tensor] = {}
        """The full tensors of the newest version (a delta's base)."""
        self.writer = self
        self.start_poller(self.prepare, each=self.stage_patch, select=None)

    def describe(self) -> str:
        return f"adapter (versions kept: {self.target.policy.versions_kept})"

    def status_fields(self) -> dict[str, Any]:
        return {"versions": tuple((v.step, v.adapter, v.identity) for v in self.versions)}

    # ------------------------------------------------------------------- staging
    def stage_patch(self, patch: TensorPatch) -> TensorPatch:
        """Poller thread: every tensor of the adapter is this rank's, kept as decoded."""
        return patch

    def prepare(self, manifest: Manifest, patches: list[Any]) -> tuple[list[TensorPatch], int]:
        """Poller thread: check the step's adapter record (a refusal stops following), then
        stage its patches as they are."""
        reason = record_refusal(self.name, manifest, self.slots, self.base_fingerprint)
        if reason is not None:
            self.refuse_from_poller(reason)
            raise DeltaSyncError(reason)
        staged = [p for p in patches if p is not None]
        nbytes = sum(p.values.numel() * p.values.element_size()
                     + (0 if p.indices is None else p.indices.numel() * p.indices.element_size())
                     for p in staged)
        return staged, nbytes

    def refuse_from_poller(self, reason: str) -> None:
        """A refusal found while staging: the poller stops itself (it is closed for good with
        the worker), nothing is staged, the status says why."""
        logger.error("deltasync rank %d refuses %s", self.rank, reason)
        self.refused = reason
        self.poller.halt()
        self.sync.drop_staged()
        self.sync.set_switch_error(reason)

    # ------------------------------------------------------------------- the writer
    def check(self) -> None:
        """vLLM dropped our versions (``reload_weights`` resets its LoRA state): forget them
        and resync through an anchor (ApplyError)."""
        lost = self._lost()
        if lost:
            raise ApplyError(f"rank {self.rank}: vLLM dropped adapter {self.name!r} versions "
                             f"{[v.step for v in lost]} (reload_weights?); resyncing through "
                             "the next anchor")

    def _lost(self) -> list[Version]:
        registered = self.slots.ids()
        lost = [v for v in self.versions if v.adapter not in registered]
        if lost:
            self.versions = [v for v in self.versions if v.adapter in registered]
            self._tensors = {}
        return lost

    def settle_writes(self) -> None:
        """At the engine core's status read: versions vLLM dropped are not reported any more
        (the engine core stops admitting requests for them); the rank resyncs."""
        lost = self._lost()
        if lost:
            self.reloads += 1
            self.sync.reset(f"vLLM dropped adapter {self.name!r} versions "
                            f"{[v.step for v in lost]}; resyncing through the newest anchor")

    @contextlib.contextmanager
    def writing(self, step: int) -> Iterator[AdapterUndo]:
        yield AdapterUndo(before=self._tensors)

    def write(self, staged: StagedStep[Any], undo: AdapterUndo) -> int:
        """The full tensors of ``staged`` (not registered yet: :meth:`finish`)."""
        manifest = staged.manifest
        base = {} if manifest.kind == "anchor" else (
            undo.tensors if undo.tensors is not None else undo.before)
        undo.tensors = build_tensors(manifest, staged.payload, base)
        undo.manifest = manifest
        return sum(t.numel() for t in undo.tensors.values())

    def finish(self, step: int, taken: list[StagedStep[Any]], undo: AdapterUndo
               ) -> tuple[int, float]:
        """Register the last step written as a new vLLM adapter version."""
        manifest, tensors = undo.manifest, undo.tensors
        assert manifest is not None and tensors is not None and manifest.adapter is not None
        version = Version(manifest.step, adapter_id(self.name, manifest.step,
                                                    manifest.identity), manifest.identity)
        if version.adapter in self.slots.ids():
            raise ApplyError(f"rank {self.rank}: adapter id {version.adapter} of {self.name!r} "
                             f"step {version.step} is registered already (an id clash); not "
                             "applied")
        t0 = time.perf_counter()
        self.slots.add(version.adapter, tensors, manifest.adapter.config)
        undo.registered = version
        self.versions.append(version)
        self._tensors = tensors
        return 0, time.perf_counter() - t0

    def put_back(self, undo: AdapterUndo) -> bool:
        """Remove the version the switch registered; the previous one is the base again."""
        self._tensors = undo.before
        version = undo.registered
        if version is None:
            return False
        undo.registered = None
        self.versions = [v for v in self.versions if v != version]
        self.slots.remove(version.adapter)
        return True

    def settled(self) -> None:
        """Nothing to note: vLLM's manager is written only through us."""

    # ------------------------------------------------------------------- retiring
    def retire(self, adapters: list[int]) -> list[int]:
        """Remove these versions (the engine core checked no request uses them), never one a
        pending switch registered (a delta's base tensors are kept apart: the newest may go
        too, before its successor registers, with ``lora_versions_kept=1``). The steps
        removed."""
        pending = self.sync.pending_step()
        keep = {v.adapter for v in self.versions if v.step == pending}
        gone = [v for v in self.versions if v.adapter in adapters and v.adapter not in keep]
        for version in gone:
            self.slots.remove(version.adapter)
        self.versions = [v for v in self.versions if v not in gone]
        if gone:
            logger.info("deltasync %s rank=%d retired steps %s (kept %s)", self.name, self.rank,
                        [v.step for v in gone], [v.step for v in self.versions])
        return [v.step for v in gone]


def build_tensors(manifest: Manifest, patches: list[TensorPatch],
                  base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full tensors of an adapter step: an anchor's from its patches alone, a delta's from
    ``base`` (the version it was computed from, never written) with its patches."""
    shapes = {e.name: tuple(e.shape) for e in manifest.tensors}
    if manifest.kind == "anchor":
        flat = {n: torch.empty(int(torch.Size(s).numel()), dtype=torch.bfloat16)
                for n, s in shapes.items()}
    else:
        missing = sorted(set(shapes) - set(base))
        if missing:
            raise ApplyError(f"step {manifest.step}: tensors {missing[:3]} are not in the version "
                             "it was computed from")
        flat = {}
    for patch in patches:
        if patch.name not in flat:
            if patch.name not in base:
                raise ApplyError(f"step {manifest.step}: tensor {patch.name!r} is not in the "
                                 "version it was computed from")
            flat[patch.name] = base[patch.name].reshape(-1).clone()
        patch.apply_to(flat[patch.name])
    out = {n: t for n, t in base.items() if n not in flat} if manifest.kind == "delta" else {}
    out.update({n: t.view(shapes.get(n, base[n].shape if n in base else t.shape))
                for n, t in flat.items()})
    return out


__all__ = ["PREFIX", "AdapterRank", "AdapterSlots", "AdapterUndo", "Version",
           "adapted_modules", "build_tensors", "record_refusal", "start_refusal"]

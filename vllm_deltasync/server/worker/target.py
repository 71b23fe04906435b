"""One followed target on one rank: poller, sync state, its half of the switch; for parameters
written in place also the shard map and the proof.

:class:`FollowedTarget` is what every target's rank holds, whatever it writes: its row, its
settings, its sync state, its poller and its half of the switch (``switching.py``), driven
through a writer its row chooses (``Target.writer``). :class:`TargetRank` is the one for
parameters written in place (the policy always, the drafter when a drafter bucket is
configured): shard map, learned layouts, packed kernels, the startup proof, reloads behind our
back (its writer is ``inplace.py``'s). A LoRA adapter's is ``adapters.py``'s ``AdapterRank``.
Each is built on the worker's main thread by the extension's ``deltasync_start``, one per
followed target (``server/targets.py``); the row of the target says what differs (its source,
its model, whether it learns layouts). It receives a typed view of the worker (``view.py``)
and reads nothing else of vLLM.

Its half of the switch (the engine core's half is ``server/engine/switch.py``): :meth:`apply`
writes every staged step up to the one the engine core chose and keeps the undo;
:meth:`commit` drops it; :meth:`revert` puts the weights back. Each answers an
:class:`~vllm_deltasync.server.messages.Outcome` the rank decides by itself: it knows whether
it ever started writing a step (``applied``, ``nothing_written``, ``put_back``, ``unknown``).
None of them raises an ``Exception``: vLLM's executor stops reading the later ranks' answers at
the first RPC that raises.

Threads: everything here runs on the worker's main thread (between model steps), except
:meth:`stage_patch` and :meth:`prepare`, which the poller's staging thread calls. What the two
share lives in ``self.sync`` (:class:`SyncState`, one lock); weights are written only here.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from vllm_deltasync import failpoints
from vllm_deltasync.errors import ApplyError, DeltaSyncError
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.codecs import prepare_decoders
from vllm_deltasync.format.manifest import Manifest, fingerprint
from vllm_deltasync.server.messages import (
    TargetStatus,
)
from vllm_deltasync.server.targets import Source, Target, Weights
from vllm_deltasync.server.worker.checkpoint import ParamSet, checkpoint_params, safetensors_files
from vllm_deltasync.server.worker.inplace import ParamWriter
from vllm_deltasync.server.worker.layouts import LayoutCache, LayoutSpec
from vllm_deltasync.server.worker.packed import PackedLayers
from vllm_deltasync.server.worker.proof import ProofReport
from vllm_deltasync.server.worker.shardmap import Piece, ShardMap
from vllm_deltasync.server.worker.state import SyncState
from vllm_deltasync.server.worker.switching import RankSwitch, Writer
from vllm_deltasync.server.worker.view import Forward, WorkerView
from vllm_deltasync.server.worker.writes import Writes

logger = logging.getLogger(__name__)


class FollowedTarget:
    """What one target holds on one rank whatever it writes (module doc): its row, settings,
    sync state, counters, poller (:meth:`start_poller`) and its half of the switch."""

    writer: Writer
    """How its steps are written and put back (``switching.py``), chosen by its row."""

    def __init__(self, view: WorkerView, target: Target, source: Source) -> None:
        from vllm_deltasync.server.metrics import WorkerStats

        self.view, self.target, self.source = view, target, source
        self.name = target.name
        self.config = source.config
        self.rank = view.rank
        self.refused: str | None = None
        """Why this rank does not follow the target (its proof, or another rank's, failed)."""
        self.report: ProofReport | None = None
        self.following = False
        self.reloads = 0
        self.fingerprint: str | None = None
        self.stats = WorkerStats()
        self.trace: collections.deque[tuple[int, int, int, int]] = collections.deque(
            maxlen=self.config.debug_ring_size)
        self.model_steps = 0
        self.sync: SyncState[Any] = SyncState(self.config.loaded_step)

    def start_poller(self, prepare: Callable[[Manifest, list[Any]], tuple[Any, int]], *,
                     each: Callable[[TensorPatch], Any] | None,
                     select: Callable[[str], bool] | None) -> None:
        """Build the switch half and the poller (started by :meth:`follow`)."""
        from vllm_deltasync.server.worker.poller import Poller

        self.switch = RankSwitch(self)
        """Its half of the switch (``switching.py``): apply, commit, revert."""
        self.poller = Poller(self.config, prepare, node_ranks=self.view.world_size, each=each,
                             select=select, fingerprint=self.fingerprint, rank=self.rank,
                             stats=self.stats, state=self.sync)

    def refuse(self, reason: str) -> None:
        """Never follow: stop the poller, drop what is staged, report ``reason``."""
        self.refused = reason
        self.close()
        self.sync.drop_staged()
        self.sync.set_switch_error(reason)

    def close(self) -> None:
        """Stop the poller for good: on a refusal, and first thing when the worker shuts
        down, so that it does not run on into what vLLM tears down under it."""
        if self.following:
            self.poller.close()
            self.following = False

    def follow(self) -> None:
        """Start the poller (after every rank's proof passed)."""
        if self.refused is None and not self.following:
            self.before_following()
            # before serving: a JIT compile would hold the GIL between batches
            prepare_decoders(jit=self.config.decoder == "auto")
            self.poller.start()
            self.following = True
            logger.info("deltasync %s started rank=%d bucket=%s %s", self.name, self.rank,
                        self.config.redacted_url(), self.describe())

    def before_following(self) -> None:
        """Right before the poller starts."""

    def describe(self) -> str:
        """What it follows, for the log line of :meth:`follow`."""
        return ""

    def settle_writes(self) -> None:
        """At the engine core's status read: settle a write behind our back (none here)."""

    def record_step(self, run: Callable[[], Any], num_tokens: int) -> Any:
        """Run one model step and remember which version it ran on, at start and at end."""
        before = _version(self.sync.applied_step)
        try:
            return run()
        finally:
            self.model_steps += 1
            self.trace.append(
                (self.model_steps, before, _version(self.sync.applied_step), num_tokens))

    def status(self) -> TargetStatus:
        """This target's status on this rank; reading it changes nothing."""
        out = dataclasses.replace(
            self.poller.status(), model=self.name, fingerprint=self.fingerprint,
            model_steps=self.model_steps, pid=os.getpid(), refused=self.refused,
            following=self.following, reloads=self.reloads,
            proof=self.report.to_dict() if self.report is not None else None,
            **self.status_fields())
        if self.refused is not None:
            out = dataclasses.replace(out, last_error=self.refused, ready_steps=(), ready_ids=())
        return out

    def status_fields(self) -> dict[str, Any]:
        """The fields of :meth:`status` only this kind of target knows."""
        return {}


class TargetRank(FollowedTarget):
    """One target whose parameters are written in place, on one rank (module doc)."""

    def __init__(self, view: WorkerView, target: Target, source: Source, weights: Weights, *,
                 bucket_params: ParamSet | None = None) -> None:
        """``bucket_params``: when the bucket is shared with another target (``source`` has a
        prefix or an exclusion), the whole parameter set of the bucket as published, whose
        fingerprint the steps carry; None there: unchecked."""
        super().__init__(view, target, source)
        self.model, self.model_path = weights
        self.checkpoint = checkpoint_params(self.model_path)
        self.layouts = LayoutCache()
        self.probing = False
        """True while our own probe runs the model's ``load_weights`` (no write behind our back)."""
        self.written_behind = False
        """A watched vLLM loader wrote the weights (server/vllm/worker.py); settled by
        :meth:`settle_writes` once the writer's call is over."""
        self.shardmap = self._build_map()
        self.packed = PackedLayers(self.model)
        """Layers computing from packed copies (``cpu_kernels="packed"``), packed again after
        every write of ours; empty in the in-place mode and on GPUs."""
        self.writes = Writes(on_discard=self._discarded)
        self.param_ids = _param_ids(self.model)
        self.param_versions = _param_versions(self.model)
        shared = bool(source.prefix or source.exclude)
        whole = bucket_params if shared else self.checkpoint
        self.fingerprint = (None if whole is None
                            else fingerprint((n, s, d) for n, (s, d) in whole.items()))
        self.writer = ParamWriter(self)
        names = set(self.shardmap.names)

        def select(bucket_name: str) -> bool:  # unknown names are read, and refused by the map
            if not source.owns(bucket_name):
                return False
            name = source.checkpoint_name(bucket_name)
            return name not in names or bool(self.shardmap.targets(name))

        each: Callable[[TensorPatch], list[Piece]] = self.stage_patch
        if source.prefix:
            each = lambda p: self.stage_patch(  # noqa: E731
                dataclasses.replace(p, name=source.checkpoint_name(p.name)))
        self.start_poller(self.prepare, each=each, select=select)

    def _build_map(self) -> ShardMap:
        """Learn the layouts kernels rearranged parameters into, then probe the loaders."""
        self.probing = True
        try:
            specs: dict[str, LayoutSpec] = {}
            learn = self.view.layout_specs if self.target.learns_layouts else None
            if learn is not None and not failpoints.armed("no_layouts"):
                params = dict(self.model.named_parameters(remove_duplicate=False))
                for name, spec in learn().items():
                    layout = self.layouts.learn(spec, params[name])
                    if not layout.identity:
                        specs[name] = spec
            return ShardMap.from_model(self.model, self.checkpoint, specs,
                                       loader=self.view.loader)
        finally:
            self.probing = False

    # ------------------------------------------------------------- the startup proof
    def prove_values(self) -> list[str]:
        """Check 1 of the startup proof (``proof.py``); returns the parameter classes held.
        A failure is kept in ``self.report`` (raised by :meth:`finish_proof`)."""
        from vllm_deltasync.server.worker.proof import check_values, class_names

        self.report = ProofReport(layouts=sorted({lay.describe()
                                                  for lay in self.layouts.layouts.values()}))
        started = time.perf_counter()
        check_values(self.shardmap, safetensors_files(self.model_path), self.report)
        self.report.seconds += time.perf_counter() - started
        return class_names(self.shardmap)

    def prove_writes(self, classes: list[str], forward: Forward | None, world: int) -> None:
        """Check 2 of the startup proof (a collective when ``world`` > 1: every rank runs it
        with the same ``classes``). Without a forward the check cannot run and fails."""
        from vllm_deltasync.server.worker.proof import check_writes

        if self.report is None:
            raise DeltaSyncError(f"rank {self.rank} {self.name}: check 2 before check 1")
        started = time.perf_counter()
        if forward is None:
            self.report.fail("the probe forward", "no forward is available to check writes")
        else:
            with self.writes.writing():
                check_writes(self.shardmap, forward, self.report, rank=self.rank, world=world,
                             classes=classes,
                             refresh=self.packed.refresh if self.packed else None)
        self.report.seconds += time.perf_counter() - started
        self.mark_written()  # the check wrote and put back: not a write behind our back

    def prove_alone(self) -> None:
        """Both checks on this rank alone, through the model's own modules (a target whose
        proof is not a collective: ``Target.collective_proof`` False). Raises ProofFailed."""
        classes = self.prove_values()
        make = self.view.module_forward
        self.prove_writes(classes, None if make is None else make(self.model), 1)
        self.finish_proof()

    def start_reproof(self) -> None:
        """After a reload behind our back (:meth:`check_reload`): a new report for check 2,
        run again on the rebuilt map by the engine core (``deltasync_prove(again=True)``).
        Check 1 is not repeated: it compares with the checkpoint on disk, and a reload may
        have loaded other weights; the learned layouts were checked with coded values."""
        from vllm_deltasync.server.worker.proof import list_classes

        self.report = ProofReport(layouts=sorted({lay.describe()
                                                  for lay in self.layouts.layouts.values()}))
        list_classes(self.shardmap, self.report, values_check="not rerun after a reload")

    def finish_proof(self) -> None:
        """Raise the first failure of the proof (ProofFailed), if any."""
        if self.report is not None:
            self.report.raise_first()

    def before_following(self) -> None:
        self.param_versions = _param_versions(self.model)  # the proof wrote and restored

    def describe(self) -> str:
        return f"tensors={len(self.shardmap.names)}"

    # ------------------------------------------------------------- reloads behind our back
    def check_reload(self, *, reloaded: bool = False) -> bool:
        """True when the model's parameters changed without us: ``reloaded`` (vLLM's
        ``reload_weights`` ran: its loaders write through ``param.data``, which does not move
        the parameters' version counters), parameters replaced, or in-place writes that moved
        their version counters. The applied step is then unknown: the layouts are learned
        again, the shard map rebuilt, and the rank resyncs through the newest anchor (the
        engine core proves the rebuilt map again, :meth:`start_reproof`)."""
        reloaded = reloaded or self.written_behind
        self.written_behind = False
        if (not reloaded and _param_ids(self.model) == self.param_ids
                and _param_versions(self.model) == self.param_versions):
            return False
        self.reloads += 1
        self.sync.reset(f"rank {self.rank}: the model's weights were changed outside deltasync "
                        "(reload_weights?); the applied step is unknown, resyncing through the "
                        "newest anchor")
        self.layouts = LayoutCache()
        self.shardmap = self._build_map()
        with self.writes.writing():  # kernels packed ahead from the old weights are void
            self.packed = PackedLayers(self.model)
            self.packed.refresh()  # the packed copies may predate the write
        self.param_ids = _param_ids(self.model)
        self.param_versions = _param_versions(self.model)
        logger.warning("deltasync %s rank %d: weights written outside deltasync; layouts learned "
                       "again, shard map rebuilt, resyncing through the newest anchor",
                       self.name, self.rank)
        return True

    def settle_writes(self) -> None:
        """At the engine core's next call after a watched loader wrote the weights: count the
        reload and rebuild the map now. Not inside the writer's call: vLLM's sparse patch
        loader still has ``torch.Tensor.copy_`` replaced there, and our probe would learn its
        NaN-masking write instead of the loader's. A rebuilt map that cannot place every
        tensor refuses (as at start)."""
        if not self.written_behind:
            return
        try:
            self.check_reload()
        except ApplyError as exc:
            logger.error("deltasync %s rank %d refuses to follow after a write behind its back: "
                         "%s", self.name, self.rank, exc)
            self.refuse(f"{type(exc).__name__}: {exc}")

    def mark_written(self) -> None:
        """Our own writes moved the parameters' version counters: remember the new ones."""
        self.param_versions = _param_versions(self.model)

    def _discarded(self) -> None:
        self.packed.prebuilt_discarded += 1

    # ------------------------------------------------------------------- staging
    def stage_patch(self, patch: TensorPatch) -> list[Piece]:
        """Poller thread, per patch as it is decoded: translate to this rank's shards and stage
        compactly (``apply.compact``) on the host, so a step's int64 decode output lives one
        patch at a time; :meth:`prepare` moves the step to the parameters' device."""
        from vllm_deltasync.server.worker.apply import compact

        return compact(self.shardmap.translate(patch))

    def prepare(self, manifest: Manifest, patches: list[Any]) -> tuple[list[Piece], int]:
        """Poller thread: translate (unless :meth:`stage_patch` did: then ``patches`` holds
        its lists of pieces), merge the sparse pieces of each parameter and move them to the
        device within ``max_device_staged_bytes`` (the rest wait in pinned host memory).
        Returns the pieces and the bytes they hold (``apply.staged_nbytes``)."""
        from vllm_deltasync.server.worker.apply import (
            compact,
            device_nbytes,
            merge_pieces,
            prepare,
            staged_nbytes,
        )

        staged: list[Piece] = []
        for i, item in enumerate(patches):
            staged.extend(compact(self.shardmap.translate(item))
                          if isinstance(item, TensorPatch) else item)
            patches[i] = None  # each patch's tensors are freed once staged
        staged.reverse()
        budget = self.config.max_device_staged_bytes - sum(
            device_nbytes(payload) for payload in self.sync.staged_payloads())
        pieces = prepare(merge_pieces(staged.pop() for _ in range(len(staged))),
                         device_budget=max(0, budget))
        if pieces and pieces[0].param.device.type == "cuda":
            torch.cuda.current_stream(pieces[0].param.device).synchronize()
        self._prebuild(manifest, pieces)
        return pieces, staged_nbytes(pieces)

    def _prebuild(self, manifest: Manifest, pieces: list[Piece]) -> None:
        """Poller thread, packed CPU kernels: pack the layers this delta touches ahead of its
        switch (``packed.py``), when the live weights are at its base step now and no write of
        ours comes between the copies and the check after them (``writes.py``)."""
        if not self.packed or manifest.kind != "delta":
            return
        seq = self.writes.seq
        if seq % 2 or self.sync.applied_step != manifest.base_step:
            return
        built = self.packed.prebuild(manifest.step, seq, pieces, self.config.max_staged_bytes)
        if built is not None:
            self.writes.offer(built, seq,
                              lambda: self.sync.applied_step == manifest.base_step)

    # ------------------------------------------------------------------- reading
    def status_fields(self) -> dict[str, Any]:
        return {"cpu_kernels": self.packed.status() if self.packed else "inplace",
                "layout_bytes": self.layouts.nbytes}


def refused_status(rank: int, name: str, reason: str) -> TargetStatus:
    """The status of a target that has no state on this rank (it was refused at start)."""
    return TargetStatus(rank=rank, model=name, refused=reason, last_error=reason,
                        pid=os.getpid())


def _param_ids(model: torch.nn.Module) -> frozenset[int]:
    return frozenset(id(p) for p in model.parameters())


def _param_versions(model: torch.nn.Module) -> tuple[int, ...]:
    """Every parameter's in-place version counter (bumped by any in-place write)."""
    return tuple(p._version for p in model.parameters())


def _version(step: int | None) -> int:
    return -1 if step is None else step


def bucket_params(policy_checkpoint: ParamSet, others: Mapping[str, ParamSet]) -> ParamSet:
    """The parameter set of a bucket shared by the policy and other targets' tensors under
    their prefixes (``others``: prefix -> that target's checkpoint)."""
    whole = dict(policy_checkpoint)
    for prefix, params in others.items():
        whole.update((prefix + n, v) for n, v in params.items())
    return whole


__all__ = ["FollowedTarget", "TargetRank", "bucket_params", "refused_status"]

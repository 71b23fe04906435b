"""One rank's state behind the worker extension: shard map, poller, apply, step trace.

Built on the worker's main thread by ``DeltaSyncExtension.deltasync_start`` and kept in the
worker's ``_deltasync`` attribute. It reads a few attributes of the vLLM worker it is given
(``rank``, ``model_runner.model``, ``vllm_config.model_config.model``) but imports no vLLM.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import ApplyError, ChainError
from vllm_deltasync.failpoints import FAIL_APPLY_ENV, NO_LAYOUTS_ENV
from vllm_deltasync.format.codec import TensorPatch
from vllm_deltasync.format.codecs import prepare_decoders
from vllm_deltasync.format.manifest import Manifest
from vllm_deltasync.format.reader import short_id
from vllm_deltasync.server.messages import LastApply, RankStatus
from vllm_deltasync.server.worker.apply import sha256_hex
from vllm_deltasync.server.worker.layouts import LayoutCache, LayoutSpec
from vllm_deltasync.server.worker.packed import PackedLayers, Prebuilt
from vllm_deltasync.server.worker.proof import ProofReport
from vllm_deltasync.server.worker.shardmap import Piece, ShardMap
from vllm_deltasync.server.worker.state import Applied, PendingSwitch, StagedStep, SyncState

logger = logging.getLogger(__name__)

FAILPOINT_ENV = FAIL_APPLY_ENV

_failpoint_fired = False



def _failpoint(rank: int, step: int) -> int | None:
    global _failpoint_fired
    spec = os.environ.get(FAILPOINT_ENV)
    if not spec or _failpoint_fired:
        return None
    want_rank, want_step, pieces = (int(x) for x in spec.split(":"))
    if (want_rank, want_step) != (rank, step):
        return None
    _failpoint_fired = True
    return pieces


class ApplyFailed(ApplyError):
    """A rank's apply failed; ``reverted`` says whether its weights were put back."""

    def __init__(self, message: str, *, reverted: bool) -> None:
        super().__init__(message)
        self.reverted = reverted


class RankState:
    """Everything one rank keeps: config, shard map, poller, counters, the step trace.

    Its methods run on the worker's main thread (vLLM calls them through ``collective_rpc``
    between model steps), except :meth:`prepare`, which the poller thread calls. Shared state
    lives in ``self.sync`` (:class:`SyncState`), whose methods take its lock; weights are only
    written here, on the main thread.
    """

    def __init__(self, worker: Any, config: SyncConfig, *,
                 layout_specs: Callable[[], Mapping[str, LayoutSpec]] | None = None,
                 model: torch.nn.Module | None = None, model_path: str | None = None,
                 role: str = "policy",
                 bucket_params: Mapping[str, tuple[tuple[int, ...], str]] | None = None) -> None:
        """``model``/``model_path``: the weights this state follows and their checkpoint (the
        worker's model by default; the speculative drafter's for ``role="drafter"``).

        ``config.drafter_prefix`` (the draft's tensors in the policy's bucket, under that
        prefix): the policy's state skips those names, the drafter's reads only them, the
        prefix removed. ``bucket_params``: then the whole parameter set of the bucket (both
        models, names as published), whose fingerprint the steps must carry; None: unchecked
        (a drafter_prefix without a draft model to read it from)."""
        from vllm_deltasync.format.manifest import fingerprint
        from vllm_deltasync.server.metrics import WorkerStats
        from vllm_deltasync.server.worker.poller import Poller

        self.config = config
        self.rank = int(getattr(worker, "rank", 0))
        self.role = role
        self.model = worker.model_runner.model if model is None else model
        self.model_path = (str(worker.vllm_config.model_config.model) if model_path is None
                           else model_path)
        params = checkpoint_params(self.model_path)
        self.checkpoint = params
        self._layout_specs = layout_specs
        self.layouts = LayoutCache()
        self.refused: str | None = None
        """Why this rank does not follow (its startup proof, or another rank's, failed)."""
        self.report: ProofReport | None = None
        self.following = False
        self.probing = False
        """True while our own probe runs the model's ``load_weights`` (no write behind our back)."""
        self.written_behind = False
        """A watched vLLM loader wrote the weights (server/vllm/worker.py); settled by
        :meth:`settle_writes` once the writer's call is over."""
        self.shardmap = self._build_map()
        self.packed = PackedLayers(self.model)
        """Layers computing from packed copies (``cpu_kernels="packed"``), packed again after
        every write of ours; empty in the in-place mode and on GPUs."""
        self.write_seq = 0
        """Sequence counter of our writes to the weights: odd while one is under way (main
        thread). Kernels packed ahead on the poller thread are used only if it did not move."""
        self._prebuilt: Prebuilt | None = None
        self._prebuilt_lock = threading.Lock()
        self._write_depth = 0
        """Nesting of :meth:`_writing` (a put-back runs inside the failed apply's write)."""
        self.param_ids = _param_ids(self.model)
        self.param_versions = _param_versions(self.model)
        self.reloads = 0
        prefix = config.drafter_prefix
        whole = params if not prefix else bucket_params
        self.fingerprint = (None if whole is None
                            else fingerprint((n, s, d) for n, (s, d) in whole.items()))
        self.stats = WorkerStats()
        self.trace: collections.deque[tuple[int, int, int, int]] = collections.deque(
            maxlen=config.debug_ring_size
        )
        self.model_steps = 0
        self.sync: SyncState[list[Piece]] = SyncState(config.loaded_step)
        names = set(self.shardmap.names)

        def mine(name: str) -> bool:  # unknown names are read, and refused by the map
            return name not in names or bool(self.shardmap.targets(name))

        each: Callable[[TensorPatch], list[Piece]] = self.stage_patch
        select: Callable[[str], bool] = mine
        if prefix and role == "drafter":
            cut = len(prefix)
            select = lambda n: n.startswith(prefix) and mine(n[cut:])  # noqa: E731
            each = lambda p: self.stage_patch(dataclasses.replace(p, name=p.name[cut:]))  # noqa: E731
        elif prefix:
            select = lambda n: not n.startswith(prefix) and mine(n)  # noqa: E731
        self.poller = Poller(
            config,
            self.prepare,
            node_ranks=_local_world(worker),
            each=each,
            select=select,
            fingerprint=self.fingerprint,
            rank=self.rank,
            stats=self.stats,
            state=self.sync,
        )

    def _build_map(self) -> ShardMap:
        """Learn the layouts kernels rearranged parameters into, then probe the loaders."""
        from vllm_deltasync.server.worker.shardmap import ShardMap

        self.probing = True
        try:
            specs: dict[str, LayoutSpec] = {}
            if self._layout_specs is not None and not os.environ.get(NO_LAYOUTS_ENV):
                params = dict(self.model.named_parameters(remove_duplicate=False))
                for name, spec in self._layout_specs().items():
                    layout = self.layouts.learn(spec, params[name])
                    if not layout.identity:
                        specs[name] = spec
            return ShardMap.from_model(self.model, self.checkpoint, specs)
        finally:
            self.probing = False

    # ------------------------------------------------------------- the startup proof
    def prove_values(self) -> list[str]:
        """Check 1 of the startup proof (``proof.py``); returns the parameter classes held.
        A failure is kept in ``self.report`` (raised by :meth:`finish_proof`)."""
        from vllm_deltasync.server.worker.proof import ProofReport, check_values, class_names

        self.report = ProofReport(layouts=sorted({lay.describe()
                                                  for lay in self.layouts.layouts.values()}))
        started = time.perf_counter()
        check_values(self.shardmap, safetensors_files(self.model_path), self.report)
        self.report.seconds += time.perf_counter() - started
        return class_names(self.shardmap)

    def prove_writes(self, classes: list[str], forward: Callable[[], torch.Tensor] | None,
                     world: int) -> None:
        """Check 2 of the startup proof (a collective: every rank runs it with the same
        ``classes``). Without a forward the check cannot run and the proof fails."""
        from vllm_deltasync.server.worker.proof import check_writes

        assert self.report is not None
        started = time.perf_counter()
        if forward is None:
            self.report.fail("the probe forward", "no forward is available to check writes")
        else:
            with self._writing():
                check_writes(self.shardmap, forward, self.report, rank=self.rank, world=world,
                             classes=classes,
                             refresh=self.packed.refresh if self.packed else None)
        self.report.seconds += time.perf_counter() - started
        self.mark_written()  # the check wrote and put back: not a write behind our back

    def start_reproof(self) -> None:
        """After a reload behind our back (:meth:`check_reload`): a new report for check 2,
        run again on the rebuilt map by the engine core (``deltasync_prove(again=True)``).
        Check 1 is not repeated: it compares with the checkpoint on disk, and a reload may
        have loaded other weights; the learned layouts were checked with coded values."""
        from vllm_deltasync.server.worker.proof import ProofReport, list_classes

        self.report = ProofReport(layouts=sorted({lay.describe()
                                                  for lay in self.layouts.layouts.values()}))
        list_classes(self.shardmap, self.report, values_check="not rerun after a reload")

    def finish_proof(self) -> None:
        """Raise the first failure of the proof (ProofFailed), if any."""
        assert self.report is not None
        self.report.raise_first()

    def refuse(self, reason: str) -> None:
        """Never follow: stop the poller, drop what is staged, report ``reason``."""
        self.refused = reason
        self.close()
        self.sync.drop_staged()
        self.sync.set_switch_error(reason)

    def close(self) -> None:
        """Stop the poller for good: on a refusal, and first thing when the worker shuts down, so
        that it does not run on into what vLLM tears down under it (and report that as a
        failure)."""
        if self.following:
            self.poller.close()
            self.following = False

    def follow(self) -> None:
        """Start the poller (after every rank's proof passed)."""
        if self.refused is None and not self.following:
            self.param_versions = _param_versions(self.model)  # the proof wrote and restored
            # before serving: a JIT compile would hold the GIL between batches
            prepare_decoders(jit=self.config.decoder == "auto")
            self.poller.start()
            self.following = True

    # ------------------------------------------------------------- reloads behind our back
    def check_reload(self, *, reloaded: bool = False) -> bool:
        """Main thread: True when the model's parameters changed without us: ``reloaded``
        (vLLM's ``reload_weights`` ran: its loaders write through ``param.data``, which does
        not move the parameters' version counters), parameters replaced, or in-place writes
        that moved their version counters. The applied step is then unknown: the layouts are
        learned again, the shard map rebuilt, and the rank resyncs through the newest anchor
        (the engine core proves the rebuilt map again, :meth:`start_reproof`)."""
        reloaded = reloaded or self.written_behind
        self.written_behind = False
        if (not reloaded and _param_ids(self.model) == self.param_ids
                and _param_versions(self.model) == self.param_versions):
            return False
        self.reloads += 1
        message = (f"rank {self.rank}: the model's weights were changed outside deltasync "
                   "(reload_weights?); the applied step is unknown, resyncing through the "
                   "newest anchor")
        self.sync.reset(message)
        self.layouts = LayoutCache()
        self.shardmap = self._build_map()
        with self._writing():  # kernels packed ahead from the old weights are void
            self.packed = PackedLayers(self.model)
            self.packed.refresh()  # the packed copies may predate the write
        self.param_ids = _param_ids(self.model)
        self.param_versions = _param_versions(self.model)
        logger.warning("deltasync rank %d: weights written outside deltasync; layouts learned "
                       "again, shard map rebuilt, resyncing through the newest anchor", self.rank)
        return True

    def settle_writes(self) -> None:
        """Main thread, at the engine core's next call after a watched loader wrote the weights
        (``written_behind``): count the reload and rebuild the map now. Not inside the writer's
        call: vLLM's sparse patch loader still has ``torch.Tensor.copy_`` replaced there, and
        our probe would learn its NaN-masking write instead of the loader's. A rank whose
        rebuilt map cannot place every tensor refuses (as at start)."""
        if not self.written_behind:
            return
        try:
            self.check_reload()
        except ApplyError as exc:
            logger.error("deltasync rank %d refuses to follow after a write behind its back: %s",
                         self.rank, exc)
            self.refuse(f"{type(exc).__name__}: {exc}")

    def mark_written(self) -> None:
        """Our own writes moved the parameters' version counters: remember the new ones."""
        self.param_versions = _param_versions(self.model)

    def stage_patch(self, patch: TensorPatch) -> list[Piece]:
        """Poller thread, per patch as it is decoded: translate to this rank's shards and stage
        (int32 indices, 16-bit values: ``apply.compact``) on the host, so a step's int64 decode
        output lives one patch at a time, never for the whole step. :meth:`prepare` moves the
        step to the parameters' device, within the device budget."""
        from vllm_deltasync.server.worker.apply import compact

        return compact(self.shardmap.translate(patch))

    def prepare(self, manifest: Manifest, patches: list[Any]) -> tuple[list[Piece], int]:
        """Poller thread: translate to this rank's shards (unless :meth:`stage_patch` did, per
        patch: then ``patches`` holds its lists of pieces), merge the sparse pieces of each
        parameter (one scatter per parameter at the switch) and move to the device.

        The returned bytes are what the staged pieces hold (``apply.staged_nbytes``): about 6
        per changed element of a 16-bit parameter, 8 of an fp32 one. Pieces of parameters on
        an accelerator go there while the steps staged hold less than
        ``max_device_staged_bytes`` on it; the rest wait in pinned host memory.

        If the main thread replaces the shard map while a step is staged it also bumps the
        state's generation, so a step translated (even in part) with the old map is never
        staged."""
        from vllm_deltasync.server.worker.apply import (
            compact,
            device_nbytes,
            merge_pieces,
            prepare,
            staged_nbytes,
        )

        shardmap = self.shardmap
        staged: list[Piece] = []
        for i, item in enumerate(patches):
            if isinstance(item, TensorPatch):
                staged.extend(compact(shardmap.translate(item)))
            else:
                staged.extend(item)
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
        ours comes between the copies and the check after them."""
        if not self.packed or manifest.kind != "delta":
            return
        seq = self.write_seq
        if seq % 2 or self.sync.applied_step != manifest.base_step:
            return
        built = self.packed.prebuild(manifest.step, seq, pieces, self.config.max_staged_bytes)
        if built is None:
            return
        with self._prebuilt_lock:
            if self.write_seq == seq and self.sync.applied_step == manifest.base_step:
                self._prebuilt = built
            else:
                self.packed.prebuilt_discarded += 1

    def _take_prebuilt(self, step: int) -> Prebuilt | None:
        """Main thread, before a switch writes: the kernels packed ahead for ``step``, if no
        write of ours came since their copies were taken."""
        with self._prebuilt_lock:
            built, self._prebuilt = self._prebuilt, None
        if built is None:
            return None
        if built.step != step or built.seq != self.write_seq:
            self.packed.prebuilt_discarded += 1
            return None
        return built

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Main thread: around every write of ours to the weights (``write_seq`` odd inside,
        nested writes included: only the outermost moves it)."""
        with self._prebuilt_lock:
            self._write_depth += 1
            if self._write_depth == 1:
                self.write_seq += 1
        try:
            yield
        finally:
            with self._prebuilt_lock:
                self._write_depth -= 1
                if self._write_depth == 0:
                    self.write_seq += 1

    def apply(self, step: int, *, identity: str | None = None) -> LastApply:
        """Main thread, between model steps: write every staged step up to ``step``
        (``identity``, when given: the manifest identity the engine core chose; a staged
        ``step`` with another identity is a :class:`ChainError`, before anything is written).

        All or nothing on this rank: if anything fails, what was written is put back (see
        :class:`~vllm_deltasync.server.worker.apply.Undo`) and :class:`ApplyFailed` says
        whether that worked. After a success the undo is kept (``SyncState``'s pending switch)
        until the engine core commits the switch (:meth:`commit`) or takes it back
        (:meth:`revert`) because another rank, or the engine core itself, failed it.
        """
        from vllm_deltasync.server.worker.apply import Undo, apply_patches

        if self.refused is not None:
            raise ApplyError(f"rank {self.rank} does not follow: {self.refused}")
        self._check_params_unchanged()
        before = self.sync.applied
        undo = Undo()
        started = time.perf_counter()
        written = 0
        prebuilt = self._take_prebuilt(step)
        with self._writing():  # kernels packed ahead are void from here
            try:
                taken = self.sync.take(step, rank=self.rank)
                _check_chain(self.rank, before, taken, identity)  # before anything is written
                for staged in taken:
                    t0 = time.perf_counter()
                    fail_after = _failpoint(self.rank, staged.step)
                    pieces = staged.payload if fail_after is None else staged.payload[:fail_after]
                    n = apply_patches(pieces, undo)
                    if fail_after is not None:
                        raise ApplyError(f"rank {self.rank}: failpoint {FAILPOINT_ENV} at step "
                                         f"{staged.step} after {len(pieces)} pieces")
                    _synchronize(staged.payload)
                    written += n
                    restart = self.sync.mark_applied(staged.manifest)
                    if restart is not None:
                        self.stats.add_branch_change()
                        logger.warning("deltasync rank=%d %s", self.rank, restart)
                    kind = "anchor" if staged.manifest.kind == "anchor" else "delta"
                    self.stats.add_apply(kind, time.perf_counter() - t0, n)
                t0 = time.perf_counter()
                params = [piece.param for piece, _ in undo.entries]
                if prebuilt is not None and [s.step for s in taken] == [prebuilt.step]:
                    repacked = self.packed.swap(prebuilt, params)
                else:
                    repacked = self.packed.refresh(params)
                repack_s = time.perf_counter() - t0
            except Exception as exc:
                self.stats.add_failure("apply", exc)
                error = f"{type(exc).__name__}: {exc}"
                reverted = self._put_back(undo, before, step, error)
                self.sync.switch_failed(step, reverted, error)
                self.mark_written()
                raise ApplyFailed(str(exc), reverted=reverted) from exc
        self.mark_written()
        last_apply: LastApply = {
            "step": step,
            "steps": [s.step for s in taken],
            "kinds": [s.manifest.kind for s in taken],
            "apply_s": time.perf_counter() - started,
            "repacked_layers": repacked,
            "repack_s": repack_s,
            "written": written,
            "downloaded_bytes": sum(s.downloaded_bytes for s in taken),
            "staged_bytes": sum(s.nbytes for s in taken),
            "changed": sum(s.manifest.totals.changed for s in taken),
            "numel": taken[-1].manifest.totals.elements,
            "published_at": taken[-1].manifest.created_at,
            "at": time.time(),
        }
        self.sync.switched(PendingSwitch(step, undo, before), last_apply)
        return last_apply

    def commit(self, step: int) -> bool:
        """The engine core made the switch to ``step`` final: drop its undo (and the pieces it
        keeps alive)."""
        return self.sync.commit(step)

    def revert(self, step: int, reason: str) -> bool:
        """Take back the switch to ``step`` because another rank, or the engine core, failed it.

        True when this rank holds the weights it had before that switch again (also when its
        own apply failed and was already put back); False when it cannot, and then the applied
        version is forgotten (resync through an anchor).
        """
        pending = self.sync.take_back(step)
        if pending is None:
            if self.sync.already_reverted(step):
                self.sync.set_switch_error(reason)
                return True
            self.sync.reset(f"{reason}; this rank holds no pending switch to step {step}")
            return False
        try:
            return self._put_back(pending.undo, pending.before, step, reason)
        finally:
            self.mark_written()

    def reset(self, reason: str) -> None:
        """Forget the applied version (the next step is reached through an anchor)."""
        self.sync.reset(reason)

    def _put_back(self, undo: Any, before: Applied, step: int, reason: str) -> bool:
        """Revert ``undo`` and rewind to ``before``; False (and a reset) when the weights could
        not be put back."""
        pieces = [piece for piece, _ in undo.entries]
        try:
            with self._writing():
                undo.revert()
                _synchronize(pieces)
                self.packed.refresh(piece.param for piece in pieces)
        except Exception as exc:  # noqa: BLE001 - reported: the weights are unknown now
            self.sync.reset(f"{reason}; could not put the weights back: {exc}")
            return False
        self.sync.rewind(before, step, reason)
        return True

    def _check_params_unchanged(self) -> None:
        """vLLM's reload_weights (or any write but ours) may have replaced or rewritten
        parameters: then re-derive the map and go to an anchor (:meth:`check_reload`)."""
        if self.check_reload():
            raise ApplyError(f"rank {self.rank}: the model's weights were changed outside "
                             "deltasync (reload_weights?); the shard map was rebuilt and the "
                             "engine resyncs through the next anchor")

    def record_step(self, run: Callable[[], Any], num_tokens: int) -> Any:
        """Run one model step and remember which version it ran on, at start and at end."""
        before = _version(self.sync.applied_step)
        try:
            return run()
        finally:
            self.model_steps += 1
            self.trace.append(
                (self.model_steps, before, _version(self.sync.applied_step), num_tokens)
            )

    def status(self) -> RankStatus:
        """This rank's status; reading it changes nothing."""
        out = self.poller.status()
        out["model"] = self.role
        out["fingerprint"] = self.fingerprint
        out["model_steps"] = self.model_steps
        out["pid"] = os.getpid()
        out["refused"] = self.refused
        out["following"] = self.following
        out["reloads"] = self.reloads
        out["cpu_kernels"] = self.packed.status() if self.packed else "inplace"
        out["proof"] = self.report.to_dict() if self.report is not None else None
        out["layout_bytes"] = self.layouts.nbytes
        if self.refused is not None:
            out["last_error"] = self.refused
            out["ready_steps"] = []
        return out


def _check_chain(rank: int, before: Applied, taken: list[StagedStep[Any]],
                 identity: str | None) -> None:
    """Identity, not numbers: each delta of ``taken`` must have been planned onto exactly the
    manifest below it (the applied one for the first), and the last step must be the one the
    engine core chose (``identity``). :class:`ChainError` before anything is written."""
    below = before[1]
    for staged in taken:
        m = staged.manifest
        if m.kind == "delta" and (below is None or below.identity is None
                                  or staged.base_identity != below.identity):
            held = "unknown weights" if below is None else (
                f"step {below.step} ({short_id(below.identity)})")
            raise ChainError(
                f"rank {rank}: step {m.step} was computed from step {m.base_step} "
                f"({short_id(staged.base_identity)}), the engine holds {held}; a delta is "
                "applied only onto the exact weights it was computed from")
        below = m
    last = taken[-1].manifest
    if identity is not None and last.identity != identity:
        raise ChainError(f"rank {rank}: step {last.step} staged here is "
                         f"{short_id(last.identity)}, the engine core chose "
                         f"{short_id(identity)}; not applied")


def _local_world(worker: Any) -> int:
    """Ranks of this engine (TP x PP): more than one share a node cache (config.node_cache)."""
    parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    return int(getattr(parallel, "world_size", 1) or 1)


def _param_ids(model: torch.nn.Module) -> frozenset[int]:
    return frozenset(id(p) for p in model.parameters())


def _param_versions(model: torch.nn.Module) -> tuple[int, ...]:
    """Every parameter's in-place version counter (bumped by any in-place write)."""
    return tuple(p._version for p in model.parameters())


def _version(step: int | None) -> int:
    return -1 if step is None else step


def _synchronize(pieces: list[Any]) -> None:
    if pieces and pieces[0].param.device.type == "cuda":
        torch.cuda.synchronize(pieces[0].param.device)


def checkpoint_params(model: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes of the checkpoint vLLM loaded (safetensors headers only)."""
    from safetensors import safe_open

    files = safetensors_files(model)
    if not files:
        raise ApplyError(
            f"no *.safetensors found for model {model!r}; deltasync needs the checkpoint's "
            "parameter set to check the bucket against it (serve a safetensors checkpoint)"
        )
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                sl = f.get_slice(name)
                dtype = str(_ST_DTYPES.get(sl.get_dtype(), sl.get_dtype())).replace("torch.", "")
                out[name] = (tuple(sl.get_shape()), dtype)
    return out


_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "BOOL": "bool"}


def safetensors_files(model: str) -> list[Path]:
    path = Path(model)
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, local_files_only=True,
                                          allow_patterns=["*.safetensors"]))
        except Exception:  # noqa: BLE001 - not in the local cache: reported by the caller
            return []
    return sorted(path.glob("*.safetensors"))


def digest_names(state: RankState, names: Iterable[str] | None) -> list[str]:
    sm = state.shardmap
    chosen = list(names) if names is not None else sm.names
    return [n for n in chosen if n not in sm.ignored and n not in sm.covered_by]


__all__ = ["FAILPOINT_ENV", "NO_LAYOUTS_ENV", "ApplyFailed", "RankState", "checkpoint_params", "digest_names", "safetensors_files", "sha256_hex"]

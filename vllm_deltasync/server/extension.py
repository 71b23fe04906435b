"""The worker extension: the methods vLLM mixes into each worker, called by ``collective_rpc``.

``vllm serve MODEL --worker-extension-cls vllm_deltasync.DeltaSyncExtension`` mixes
:class:`DeltaSyncExtension` into every worker. vLLM never calls an extension's ``__init__`` and
nothing calls its methods unless someone sends ``collective_rpc``: the engine core's
coordinator does (``server/engine/coordinator.py``, started by the plugin's hook on the engine
core, ``server/vllm/``): ``deltasync_start`` on every rank (each builds its targets' shard maps
and proves its writes), ``deltasync_prove`` (the collective half of the proof),
``deltasync_follow`` (pollers start), then each tick ``deltasync_status`` and, when every rank
has the same next step of a target staged, ``deltasync_apply(step, model=<target>)`` followed
by ``deltasync_commit`` (or ``deltasync_revert`` on every rank).

Why every rank switches before the same batch: ``collective_rpc`` from the engine core goes
through the same broadcast queue as ``execute_model``, and every worker runs them in order on
its main thread, so all ranks apply between the same two model steps; ranks stage and fully
prepare a step (download, verify, decode, translate, move to device) before reporting it ready.

The methods are thin: each answers from the rank's :class:`~.worker.rank.Rank` (one
``FollowedTarget`` per followed target, ``model`` naming which: ``server/targets.py``) and turns the
typed answer into the dict that crosses the RPC. What this module reads from vLLM's worker goes
through ``server/vllm/worker.py`` (a typed view); it imports no vLLM module itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from vllm_deltasync import failpoints
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import ApplyError, DeltaSyncError
from vllm_deltasync.server import surface_check
from vllm_deltasync.server.targets import POLICY
from vllm_deltasync.server.vllm import guard, plugin, surface
from vllm_deltasync.server.vllm import worker as vllm_worker
from vllm_deltasync.server.worker.checkpoint import digest_names, safetensors_files
from vllm_deltasync.server.worker.rank import Rank, refused
from vllm_deltasync.server.worker.target import FollowedTarget, TargetRank

logger = logging.getLogger(__name__)

PRIMARY = POLICY.name

_EXCLUDED = guard.allowlist_excludes(os.environ)
if _EXCLUDED is not None:
    logger.warning("VLLM_PLUGINS=%r does not name %r: vLLM does not run vllm-deltasync's plugin in "
                   "this server, so the extension loads nothing more and follows no bucket (add "
                   "%r to VLLM_PLUGINS to follow)", _EXCLUDED, guard.PLUGIN_NAME,
                   guard.PLUGIN_NAME)


class DeltaSyncExtension:
    """Mixed into vLLM's worker by ``--worker-extension-cls vllm_deltasync.DeltaSyncExtension``.

    No ``__init__`` (vLLM never calls it) and every name is prefixed, because vLLM refuses an
    extension attribute the worker already has. The engine core calls these by
    ``collective_rpc``; users can too (``LLM.collective_rpc("deltasync_status")``).
    """

    _deltasync: Rank | None

    def _deltasync_rank(self) -> Rank:
        rank = getattr(self, "_deltasync", None)
        if rank is None:
            raise DeltaSyncError("deltasync is not started on this worker (deltasync_start)")
        return rank

    def _deltasync_target(self, model: str) -> FollowedTarget:
        return self._deltasync_rank().get(model)

    def _deltasync_params(self, model: str) -> TargetRank:
        state = self._deltasync_rank().get(model)
        if not isinstance(state, TargetRank):
            raise DeltaSyncError(f"{model!r} is a LoRA adapter: it has no parameters of the "
                                 "model to digest")
        return state

    def deltasync_start(self) -> dict[str, Any]:
        """Build every followed target (shard maps, learned layouts), prove the targets whose
        proof is their own, and run check 1 of the collective proof. The pollers start only
        with ``deltasync_follow``, once every rank passed ``deltasync_prove``. Never raises: a
        rank that cannot follow answers ``refused`` with the reason. Idempotent."""
        if getattr(self, "_deltasync", None) is not None:
            return self.deltasync_status()
        view = vllm_worker.view_of(self)
        vllm_worker.pipeline_buffers(self)  # serving needs them, following or not
        try:
            if guard.PLUGIN_REFUSALS:
                raise DeltaSyncError(" ".join(guard.PLUGIN_REFUSALS))
            config = SyncConfig.from_sources(view.additional_config, os.environ)
            rank = Rank.build(view, config, missing=_missing)
        except DeltaSyncError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            logger.error("deltasync rank %d refuses to follow: %s", view.rank, reason)
            return refused(view.rank, reason).to_wire()
        self._deltasync = rank
        vllm_worker.quiet_status_reads()
        vllm_worker.wrap_worker(self, rank.record_step, rank.close)
        vllm_worker.watch_weight_writes(self, rank.primary)
        classes = rank.primary.prove_values()
        return rank.status(with_classes=classes).to_wire()

    def deltasync_prove(self, classes: list[str], again: bool = False) -> dict[str, Any]:
        """Check 2 of the collective startup proof (``classes``: the union over ranks, in the
        same order everywhere). The answer has ``refused`` set when the proof failed on this
        rank (one log line names the parameter and the reason). ``again``: after a reload
        behind our back, on the rebuilt map (``TargetRank.start_reproof``)."""
        from vllm_deltasync.server.worker.proof import ProofFailed

        rank = self._deltasync_rank()
        state, view = rank.primary, vllm_worker.view_of(self)
        if again:
            state.start_reproof()
        probe = view.probe_forward
        state.prove_writes(list(classes), None if probe is None else probe(),
                           view.tensor_parallel_size)
        try:
            state.finish_proof()
        except ProofFailed as exc:
            logger.error("deltasync rank %d refuses to follow: %s", rank.rank, exc)
            state.refuse(f"{type(exc).__name__}: {exc}")
        else:
            report = state.report
            logger.info("deltasync rank %d %s proof passed in %.2fs (%d classes; %s)", rank.rank,
                        "reload" if again else "startup", report.seconds if report else 0.0,
                        len(report.classes) if report else 0,
                        "; ".join(report.layouts) if report and report.layouts
                        else "no learned layouts")
        return self.deltasync_status()

    def deltasync_follow(self) -> dict[str, Any]:
        """Every rank passed its proof: start every target's poller."""
        self._deltasync_rank().follow()
        return self.deltasync_status()

    def deltasync_stop(self, reason: str) -> dict[str, Any] | None:
        """Some rank refused (or the engine core shut down): no target follows here either."""
        rank = getattr(self, "_deltasync", None)
        if rank is None:
            return None
        rank.stop(reason)
        return self.deltasync_status()

    def deltasync_status(self) -> dict[str, Any]:
        """This rank's status: each target's applied/staged/newest step, last error, counters
        (``server/messages.py``). Reading it changes nothing, except that a write behind our
        back noted since the last call is settled first (counted in ``reloads``)."""
        rank = self._deltasync_rank()
        rank.settle_writes()
        return rank.status().to_wire()

    def deltasync_ready(self, model: str = PRIMARY) -> list[int]:
        """Steps of target ``model`` staged and fully prepared on this rank, in apply order."""
        return self._deltasync_target(model).sync.ready_steps()

    def deltasync_apply(self, step: int, identity: str | None = None,
                        model: str = PRIMARY) -> dict[str, Any]:
        """Apply every staged step of target ``model`` up to ``step`` (``identity``: the
        manifest the engine core chose) in place; the answer says what this rank's weights
        are now (``outcome``). The switch stays pending until ``deltasync_commit`` or
        ``deltasync_revert``. Never raises on purpose (``server/worker/switching.py``)."""
        state = self._deltasync_target(model)
        _apply_rpc_failpoint(state, step)  # test-only: raises out of the RPC
        return state.switch.apply(step, identity).to_wire()

    def deltasync_commit(self, step: int, model: str = PRIMARY) -> dict[str, Any]:
        """The engine core made the switch to ``step`` final: drop its undo (idempotent)."""
        return self._deltasync_target(model).switch.commit(step).to_wire()

    def deltasync_revert(self, step: int, reason: str, model: str = PRIMARY) -> dict[str, Any]:
        """Take back this rank's switch to ``step``; the rank decides from what it did whether
        its weights are as before (``put_back`` / ``nothing_written``) or unknown."""
        return self._deltasync_target(model).switch.revert(step, reason).to_wire()

    def deltasync_retire(self, adapters: list[int], model: str) -> dict[str, Any]:
        """Remove these versions of LoRA adapter ``model`` (the engine core checked that no
        request uses them; ``server/engine/versions.py``); answers the adapter's status."""
        from vllm_deltasync.server.worker.adapters import AdapterRank

        state = self._deltasync_target(model)
        if isinstance(state, AdapterRank):
            state.retire([int(a) for a in adapters])
        return state.status().to_wire()

    def deltasync_reset(self, reason: str, model: str = PRIMARY) -> None:
        """Forget the applied version (the next step is reached through an anchor). Never
        raises (logged)."""
        try:
            self._deltasync_target(model).switch.reset(reason)
        except Exception:  # noqa: BLE001 - the engine core sends it again while it holds
            logger.exception("deltasync reset failed")

    def deltasync_trace(self, last: int | None = None) -> list[tuple[int, int, int, int]]:
        """Recent model steps on this rank: (n, version at start, version at end, tokens)."""
        trace = list(self._deltasync_rank().primary.trace)
        return trace[-last:] if last else trace

    def deltasync_weight_digests(self, names: Iterable[str] | None = None,
                                 model: str = PRIMARY) -> dict[str, str]:
        """sha256 of the live elements of each checkpoint tensor of target ``model`` held by
        this rank."""
        from vllm_deltasync.server.worker.apply import tensor_digest

        state = self._deltasync_params(model)
        return {n: tensor_digest(state.shardmap, n) for n in digest_names(state.shardmap, names)}

    def deltasync_checkpoint_digests(self, path: str, names: Iterable[str] | None = None,
                                     model: str = PRIMARY) -> dict[str, str]:
        """The digests this rank would report if target ``model`` held the checkpoint at
        ``path`` (a directory of ``*.safetensors`` or one file)."""
        from safetensors.torch import load_file

        from vllm_deltasync.server.worker.apply import checkpoint_digest

        state = self._deltasync_params(model)
        tensors: dict[str, torch.Tensor] = {}
        for f in safetensors_files(path):
            tensors.update(load_file(str(f)))
        if not tensors:
            raise ApplyError(f"no safetensors checkpoint at {path!r}")
        return {n: checkpoint_digest(state.shardmap, n, tensors[n])
                for n in digest_names(state.shardmap, names) if n in tensors}


def _missing(scope: str) -> list[str]:
    """Why this vLLM cannot serve the targets of ``scope``: one line per missing symbol."""
    return [f"vLLM {surface.vllm_version()} lacks {line}"
            for line in surface_check.cached_problems(scope)]


def _apply_rpc_failpoint(state: FollowedTarget, step: int) -> None:
    """Test-only (``failpoints.py``, ``apply_rpc``): raise out of ``deltasync_apply`` on that
    rank and step before anything is written, once per process; ``dirty``: as if the apply
    had started and never answered."""
    for args in failpoints.armed("apply_rpc"):
        if args[:3] == (state.name, str(state.rank), str(step)) and failpoints.once(
                "apply_rpc", args):
            if args[3:] == ("dirty",):
                state.switch.mark_writing(step)
            raise RuntimeError(f"failpoint apply_rpc: rank {state.rank}'s deltasync_apply of "
                               f"step {step} raises out of the RPC")


register_plugin = plugin.register_plugin
"""The 0.1 entry point ``vllm_deltasync.extension:register_plugin`` still resolves (an older
install's entry point keeps it until ``pip install`` runs again)."""

__all__ = ["DeltaSyncExtension", "register_plugin"]

"""The receiver of vLLM's weight-transfer API for backend ``deltasync`` (one per worker).

Loaded only by vLLM's lazy ``WeightTransferEngineFactory`` loader (registered by
:func:`.plugin.register_plugin`), in the workers of an engine started with
``--weight-transfer-config '{"backend": "deltasync"}'``: it subclasses vLLM's
``WeightTransferEngine``, so it imports vLLM at module level (the one module of
``server/vllm/`` that does; tests/test_architecture.py names it).

The update itself never runs here. The trainer side (``trainer/weight_transfer.py``) publishes
a step to the bucket, then calls ``update_weights({"step": N, "identity": ...})``; the engine
core's coordinator takes that call (``engine.py``, ``_hook_weight_transfer``): it waits until
every rank has step N staged by its poller, then switches every rank at once, in place, as
when following a bucket (the requests' KV by in_flight, weight version, commit; or taken back on every
rank). So ``start_weight_update`` / ``finish_weight_update`` are no-ops here, and
:meth:`DeltaSyncWeightTransferEngine.receive_weights` is reached only when the coordinator did
not take the call; it raises, saying why.

An error here is raised by the engine's last rank only (the others answer None): vLLM's
multiprocessing executor reads the ranks' answers in rank order and stops at the first
failure, so a failure raised by every rank would leave the later ranks' answers to be read by
the next call (every answer after it off by one call).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from vllm_deltasync._urls import redact_url
from vllm_deltasync.config import SyncConfig, is_configured
from vllm_deltasync.errors import DeltaSyncError


@dataclass
class DeltaSyncInitInfo(WeightTransferInitInfo):
    """What the trainer sends at ``init_weight_transfer_engine``: the bucket it publishes to
    (optional; when given it must be the bucket this server follows)."""

    url: str | None = None


@dataclass
class DeltaSyncUpdateInfo(WeightTransferUpdateInfo):
    """One update: the bucket step to switch to and its manifest identity (None: steps only)."""

    step: int
    identity: str | None = None


class DeltaSyncWeightTransferEngine(WeightTransferEngine[DeltaSyncInitInfo, DeltaSyncUpdateInfo]):
    """Backend ``deltasync``: the trainer publishes to a bucket, the engine core switches."""

    init_info_cls = DeltaSyncInitInfo
    update_info_cls = DeltaSyncUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: DeltaSyncInitInfo) -> None:
        """Check that this server follows the trainer's bucket (nothing to open: the bucket is
        the transport). A clear error when the extension or the bucket is missing, or the
        trainer names another bucket."""
        from vllm_deltasync.server.engine.trainer import same_bucket

        try:
            config = self._server_config()
            if init_info.url is not None and not same_bucket(init_info.url, config.url):
                raise ValueError(
                    f"weight-transfer backend 'deltasync': the trainer publishes to "
                    f"{redact_url(init_info.url)} but this server follows "
                    f"{config.redacted_url()} (VLLM_DELTASYNC_URL / additional_config "
                    "deltasync.url); give both the same bucket")
        except ValueError as exc:
            self._raise_on_last_rank(exc)

    def start_weight_update(self) -> None:
        """Nothing to prepare: the switch happens in place, in the engine core's coordinator."""

    def finish_weight_update(self) -> None:
        """Nothing to finish: the coordinator committed the switch and set the weight version."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's, without its ``torch.accelerator.synchronize()``: nothing was received on
        this worker (and on the CPU build there is no accelerator to synchronize)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        """Reached only when the engine core's coordinator did not take ``update_weights``."""
        self._raise_on_last_rank(RuntimeError(
            f"update_weights to step {update_info.step}: weight-transfer backend 'deltasync' "
            "is applied by the engine core's deltasync coordinator, which did not take this "
            f"call: {self._why_not_taken()}"))

    def shutdown(self) -> None:
        """Nothing to release (no connection to the trainer)."""

    # ----------------------------------------------------------------------------- helpers
    def _raise_on_last_rank(self, error: Exception) -> None:
        """Raise ``error`` on this engine's last rank only (see the module doc)."""
        if self._last_rank():
            raise error

    def _last_rank(self) -> bool:
        from vllm.distributed.parallel_state import get_world_group

        world = int(getattr(self.parallel_config, "world_size", 1) or 1)
        try:
            rank = int(get_world_group().rank_in_group) % world
        except (AssertionError, AttributeError, RuntimeError):  # no group: one rank
            return True
        return rank == world - 1

    def _server_config(self) -> SyncConfig:
        from vllm_deltasync.server.vllm.guard import extension_configured

        if not extension_configured(self.vllm_config):
            raise ValueError(
                "weight-transfer backend 'deltasync' needs the deltasync extension: start vLLM "
                "with --worker-extension-cls vllm_deltasync.DeltaSyncExtension and a bucket URL "
                "(VLLM_DELTASYNC_URL)")
        additional: Any = self.vllm_config.additional_config
        if not is_configured(additional, os.environ):
            raise ValueError(
                "weight-transfer backend 'deltasync' needs the bucket this server follows: set "
                "VLLM_DELTASYNC_URL or --additional-config '{\"deltasync\": {\"url\": ...}}'")
        try:
            return SyncConfig.from_sources(additional, os.environ)
        except DeltaSyncError as exc:
            raise ValueError(f"weight-transfer backend 'deltasync': invalid deltasync "
                             f"configuration: {exc}") from exc

    def _why_not_taken(self) -> str:
        from vllm_deltasync.server.vllm.engine import surface_refusal

        try:
            self._server_config()
        except ValueError as exc:
            return str(exc)
        refusal = surface_refusal()
        if refusal is not None:
            return f"the extension refused at start: {refusal}"
        return ("the extension did not hook this engine core (its log and /synced say why); "
                "vLLM's weights are unchanged")


__all__ = ["DeltaSyncInitInfo", "DeltaSyncUpdateInfo", "DeltaSyncWeightTransferEngine"]

"""The trainer side of vLLM's weight-transfer API for backend ``deltasync``.

A framework that drives vLLM through ``WeightTransferTrainerFactory`` (TRL, SkyRL, prime-rl)
picks the bucket as its transport with no other change::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm_deltasync.trainer.weight_transfer import DeltaSyncTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        DeltaSyncTrainerInitInfo(url="s3://rl-runs/policy", rank=rank),
        client=HTTPVLLMWeightSyncClient("http://rollout-0:8000"), source=ModuleSource(model))
    for step in ...:
        train_step()
        engine.send_weights()          # publish, wait for the commit, switch the server

``send_weights`` on the sender (trainer rank 0) publishes a step with a
:class:`~vllm_deltasync.trainer.publisher.DeltaPublisher` (anchors and deltas as usual), waits
until it is committed (``flush``), then drives the server through the
``VLLMWeightSyncClient`` protocol: ``start_weight_update``, ``update_weights({"step": N,
"identity": <manifest identity>})``, ``finish_weight_update(weight_version=str(N))``. The
server's engine core switches every rank to step N in place (``server/vllm/weight_transfer.py``).
Other ranks iterate the source in lockstep (materializing FSDP parameters is collective) and
send nothing.

It subclasses vLLM's ``TrainerWeightTransferEngine``, so this module imports vLLM at module
level (tests/test_architecture.py names it); nothing else in ``trainer/`` does. Importing it
registers the engine in ``WeightTransferTrainerFactory`` when the package's vLLM plugin has not
(a trainer process need not load vLLM's plugins), and so does building a
:class:`DeltaSyncTrainerInitInfo`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from vllm_deltasync.format.manifest import Manifest
from vllm_deltasync.trainer.publisher import DeltaPublisher

logger = logging.getLogger(__name__)

BACKEND = "deltasync"


@dataclass
class DeltaSyncTrainerInitInfo(TrainerInitInfo):
    """Backend ``deltasync``: the bucket the trainer publishes to (``rank``: this trainer
    process's rank, keyword-only; rank 0 publishes and drives the server)."""

    backend: ClassVar[str] = BACKEND

    url: str
    """The bucket (``file://``, ``hf://buckets/...``, ``s3://...``) the servers follow."""
    publisher_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of :class:`DeltaPublisher` (``anchor_every``, ``codec``,
    ``store_options``, ``run_id``, ...)."""
    server_url: str | None = None
    """The same bucket as the servers name it, when that differs from ``url`` (another mount
    point, another endpoint); sent at ``init_weight_transfer_engine`` and checked there."""

    def __post_init__(self) -> None:
        register()  # the factory knows the backend whenever its init info exists


class DeltaSyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[DeltaSyncTrainerInitInfo]):
    """Publishes each send as a bucket step, then has the server switch to it."""

    init_info_cls = DeltaSyncTrainerInitInfo

    def __init__(self, init_info: DeltaSyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                 source: WeightSource | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self._identities: dict[int, str | None] = {}
        self._lock = threading.Lock()
        self.publisher: DeltaPublisher | None = None
        if self.is_sender:
            options = dict(init_info.publisher_options)
            on_commit = options.pop("on_commit", None)
            self.publisher = DeltaPublisher(init_info.url, on_commit=self._on_commit(on_commit),
                                            **options)

    @classmethod
    def trainer_init(cls, init_info: DeltaSyncTrainerInitInfo, *,
                     client: VLLMWeightSyncClient, source: WeightSource | None = None) -> Self:
        """Every trainer rank; the sender opens the publisher and has the server check that it
        follows this bucket (``init_weight_transfer_engine({"url": ...})``)."""
        if not isinstance(init_info, DeltaSyncTrainerInitInfo):
            raise TypeError(f"backend 'deltasync' takes DeltaSyncTrainerInitInfo, got "
                            f"{type(init_info).__name__}")
        engine = cls(init_info, client=client, source=source)
        if engine.is_sender:
            try:
                client.init_weight_transfer_engine({"url": init_info.server_url or init_info.url})
            except BaseException:
                engine.shutdown()
                raise
        return engine

    def send_weights(  # type: ignore[override]  # vLLM's returns None; the step is useful
            self, step: int | None = None,
            named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> int | None:
        """Publish one step and switch the server to it (every trainer rank calls this).

        ``step``: the bucket step (default: the publisher's ``next_step``, one after the newest
        published). ``named_tensors``: the weights, default the ``WeightSource`` given at
        ``trainer_init``. Returns the step on the sender, None on other ranks (which only
        iterate the weights, in lockstep). Errors of the server (the step not staged in time,
        a switch taken back) raise here, after the update session is closed."""
        weights = named_tensors if named_tensors is not None else self.source
        if weights is None:
            raise ValueError("send_weights: no weights; give a WeightSource at trainer_init or "
                             "pass named_tensors")
        if not self.is_sender:
            for _ in weights:  # materializing (FSDP full_tensor) is collective
                pass
            return None
        assert self.publisher is not None
        step = self.publisher.next_step if step is None else step
        self.publisher.publish(step, weights)
        self.publisher.flush()
        with self._lock:
            identity = self._identities.get(step)
        self.client.start_weight_update()
        try:
            self.client.update_weights({"step": step, "identity": identity})
        except BaseException:
            # the workers' update session stays open unless it is finished (the engine core
            # took the call, not the workers): close it, no version, then raise
            with contextlib.suppress(Exception):
                self.client.finish_weight_update()
            raise
        self.client.finish_weight_update(weight_version=str(step))
        return step

    def identity(self, step: int) -> str | None:
        """The manifest identity of a step this engine committed (None: format version 1)."""
        with self._lock:
            return self._identities.get(step)

    def shutdown(self) -> None:
        """Commit what is queued and close the publisher."""
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close()

    def _on_commit(self, user: Callable[[Manifest], None] | None) -> Callable[[Manifest], None]:
        def committed(manifest: Manifest) -> None:
            with self._lock:
                self._identities[manifest.step] = manifest.identity
                for old in sorted(self._identities)[:-16]:
                    del self._identities[old]
            if user is not None:
                user(manifest)

        return committed


def register() -> None:
    """Register the trainer engine in vLLM's ``WeightTransferTrainerFactory`` unless a
    ``deltasync`` engine is registered already. Never raises (a warning line instead)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        WeightTransferTrainerFactory.register_engine(BACKEND, DeltaSyncTrainerWeightTransferEngine)
    except ValueError as exc:
        if "already registered" not in str(exc):
            logger.warning("vllm-deltasync could not register weight-transfer backend %r: %s",
                           BACKEND, exc)
    except Exception as exc:  # noqa: BLE001 - importing this module must not fail on it
        logger.warning("vllm-deltasync could not register weight-transfer backend %r: %s: %s",
                       BACKEND, type(exc).__name__, exc)


register()

__all__ = ["BACKEND", "DeltaSyncTrainerInitInfo", "DeltaSyncTrainerWeightTransferEngine",
           "register"]

"""vllm-deltasync: sparse bf16 weight deltas through an object-store bucket into vLLM.

Trainer side::

    from vllm_deltasync import DeltaPublisher

    with DeltaPublisher("file:///data/policy-bucket", anchor_every=10) as pub:
        for step in range(num_steps):
            train_step()
            pub.publish(step, model.named_parameters())

Importing this package never imports vLLM; ``vllm_deltasync.DeltaSyncExtension`` (the worker
extension vLLM loads by name) is resolved lazily from :mod:`vllm_deltasync.server.extension`.
"""

from __future__ import annotations

from typing import Any

from vllm_deltasync import _moved
from vllm_deltasync.errors import (
    AlreadyExistsError,
    ApplyError,
    AuthError,
    ChainError,
    ConfigError,
    DeltaSyncError,
    FingerprintError,
    FormatError,
    IntegrityError,
    NotFoundError,
    PublishError,
    RateLimitedError,
    StoreError,
    TransientStoreError,
    UnsupportedFormatError,
)
from vllm_deltasync.format.manifest import Manifest
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.stores import open_store
from vllm_deltasync.trainer.options import PublisherOptions
from vllm_deltasync.trainer.publisher import DeltaPublisher

_moved.install()

__version__ = "0.4.0"


def __getattr__(name: str) -> Any:
    if name == "DeltaSyncExtension":
        from vllm_deltasync.server.extension import DeltaSyncExtension

        return DeltaSyncExtension
    raise AttributeError(f"module 'vllm_deltasync' has no attribute {name!r}")


__all__ = [
    "AlreadyExistsError",
    "ApplyError",
    "AuthError",
    "BucketReader",
    "ChainError",
    "ConfigError",
    "DeltaPublisher",
    "DeltaSyncError",
    "DeltaSyncExtension",
    "FingerprintError",
    "FormatError",
    "IntegrityError",
    "Manifest",
    "NotFoundError",
    "PublishError",
    "PublisherOptions",
    "RateLimitedError",
    "StoreError",
    "TransientStoreError",
    "UnsupportedFormatError",
    "__version__",
    "open_store",
]

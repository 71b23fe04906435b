"""Whether an engine core may follow at all, decided once at its start.

The facts come from vLLM's config, read by ``server/vllm/engine.py`` into plain values
(:class:`EngineFacts`); the decisions are here: an engine layout whose engines would switch
independently inside one forward is refused, an invalid configuration is refused without
killing the engine (it serves its checkpoint, ``/synced`` says why), and under data parallel
every engine core serves its own metrics port.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_deltasync.config import ADDITIONAL_CONFIG_KEY, ENV_PREFIX, SyncConfig, is_configured
from vllm_deltasync.errors import DeltaSyncError
from vllm_deltasync.server.engine.trainer import conflict

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineFacts:
    """What the decisions need from one engine core's vLLM config."""

    data_parallel_size: int
    data_parallel_index: int
    is_moe: bool
    executor_backend: str | None
    ranks_per_model: int
    """Tensor x pipeline parallel size."""
    weight_transfer_backend: str | None
    additional_config: Mapping[str, Any]


def unsupported_layout(facts: EngineFacts) -> str | None:
    """Why this engine layout cannot follow a bucket safely, or None.

    A MoE model with data parallel size > 1 runs one engine core per DP rank, and vLLM shards
    its experts (and their all-to-all / all-reduce) across DP x TP: every forward of one engine
    computes with the other engines' experts. The engines switch independently (each between
    its own batches), so a forward could mix expert weights of two steps. Refused until a
    cross-engine barrier exists. Dense models at DP > 1 are independent engines and follow.

    The same holds for ``distributed_executor_backend="external_launcher"`` (torchrun, one
    in-process engine core per rank, each reaching only its own worker) with tensor or
    pipeline parallel size > 1: the ranks of one model would switch independently."""
    dp = facts.data_parallel_size
    if dp > 1 and facts.is_moe:
        return (f"a MoE model with data parallel size {dp} (--data-parallel-size) is not "
                "supported: vLLM shards its experts across the engines of all DP ranks, which "
                "would switch independently and run forwards mixing expert weights of two "
                "steps. Serve it with --data-parallel-size 1 (tensor parallel instead), or as "
                "separate servers")
    world = facts.ranks_per_model
    if facts.executor_backend == "external_launcher" and world > 1:
        return (f"distributed_executor_backend='external_launcher' with {world} ranks per model "
                "is not supported: each rank's engine core reaches only its own worker, so the "
                "ranks would switch independently and mix two steps in one forward. Use vLLM's "
                "own executor (mp, the default) for tensor/pipeline parallel")
    return None


def coordinator_config(facts: EngineFacts, environ: Mapping[str, str],
                       surface_refusal: str | None) -> tuple[SyncConfig, str | None] | None:
    """This engine core's settings and the reason it refuses to follow (None: it follows);
    None when deltasync is not configured at all. A bad setting (a misspelt
    ``VLLM_DELTASYNC_*`` variable, a value out of range) must not kill the engine core after
    its start was reported (the caller would wait forever): it serves its checkpoint and
    ``/synced`` says why."""
    additional = facts.additional_config
    refuse = (surface_refusal or unsupported_layout(facts)
              or conflict(facts.weight_transfer_backend))
    try:
        config = SyncConfig.from_sources(additional, environ)
    except DeltaSyncError as exc:
        if not is_configured(additional, environ):
            logger.warning("deltasync: %s; the engine serves its checkpoint only", exc)
            return None
        refuse = f"invalid deltasync configuration: {type(exc).__name__}: {exc}"
        config = refusal_config(additional, environ)
    else:
        if refuse is not None:
            logger.error("deltasync refuses to follow: %s", refuse)
    return engine_config(config, facts.data_parallel_index), refuse


def engine_config(config: SyncConfig, data_parallel_index: int) -> SyncConfig:
    """The settings of this engine core: under data parallel every engine core serves its own
    metrics endpoint, on ``metrics_port + data-parallel rank`` (rank 0 on ``metrics_port``)."""
    if not config.metrics_port or not data_parallel_index:
        return config
    return dataclasses.replace(config, metrics_port=config.metrics_port + data_parallel_index)


def refusal_config(additional_config: Any, environ: Mapping[str, str]) -> SyncConfig:
    """The settings of a coordinator that only refuses, the configuration being invalid: the
    metrics endpoint on the port the user asked for where that much parses (else the default),
    so that ``/synced`` answers 503 with the reason."""
    section = (additional_config.get(ADDITIONAL_CONFIG_KEY)
               if isinstance(additional_config, Mapping) else None)
    section = section if isinstance(section, Mapping) else {}
    port = SyncConfig.metrics_port
    for raw in (environ.get(ENV_PREFIX + "METRICS_PORT"), section.get("metrics_port")):
        with contextlib.suppress(TypeError, ValueError):
            text = str(raw).strip() if raw is not None else ""
            if text.isascii() and text.isdigit() and 0 <= int(text) <= 65535:
                port = int(text)
                break
    for url in (environ.get(ENV_PREFIX + "URL"), section.get("url")):
        with contextlib.suppress(DeltaSyncError, TypeError):
            if url:
                return SyncConfig(url=str(url), metrics_port=port)
    return SyncConfig(url="file:///invalid-deltasync-configuration", metrics_port=port)


__all__ = ["EngineFacts", "coordinator_config", "engine_config", "refusal_config",
           "unsupported_layout"]

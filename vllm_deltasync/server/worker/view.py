"""What a rank knows of the vLLM worker it runs in: a typed view, built once at start.

``server/vllm/worker.py`` builds it from vLLM's worker (``view_of``), reading every vLLM
attribute there; the rank's code (``server/worker/``) and the extension receive this view and
never touch a vLLM object by attribute. Tests build one directly around a plain model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_deltasync.server.worker._shardprobe import Loader
from vllm_deltasync.server.worker.layouts import LayoutSpec

if TYPE_CHECKING:
    from vllm_deltasync.server.worker.adapters import AdapterSlots

Forward = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class WorkerView:
    """One rank of one engine."""

    rank: int
    model: torch.nn.Module
    """The policy's model (written in place)."""
    model_path: str
    """The policy's checkpoint (a directory of ``*.safetensors`` or a hub id in the local cache)."""
    loader: Loader
    """The engine's loading machinery the shard-map probe runs (``server/vllm/loaders.py``)."""
    world_size: int = 1
    """Ranks of this engine (tensor x pipeline parallel): more than one share a node cache."""
    tensor_parallel_size: int = 1
    additional_config: Mapping[str, Any] = field(default_factory=dict)
    """The engine's ``additional_config`` (its ``deltasync`` section holds our settings)."""
    drafter: tuple[torch.nn.Module, str] | None = None
    """The speculative draft model this worker runs and its checkpoint, if any."""
    layout_specs: Callable[[], Mapping[str, LayoutSpec]] | None = None
    """The policy's parameters whose kernel may rearrange them after loading (MoE experts),
    read from the current model each time (a reload rebuilds them)."""
    probe_forward: Callable[[], Forward | None] | None = None
    """The startup proof's forward through the runner's own code path (a collective at TP>1)."""
    module_forward: Callable[[torch.nn.Module], Forward] | None = None
    """A forward through one model's own modules (no collective): a draft model's proof."""
    lora: AdapterSlots | None = None
    """vLLM's LoRA manager of this worker (``server/vllm/lora.py``), None without
    ``--enable-lora``: where followed LoRA adapters' versions go."""


__all__ = ["Forward", "WorkerView"]

"""What the engine core's side of following needs from vLLM's engine core, and nothing more.

``server/vllm/engine.py`` implements it on vLLM's ``EngineCore`` (``EngineHandle``); the unit
tests implement it on a stand-in. The coordinator, the followers, the switch and the gate
reach the engine only through these methods, so none of them touches a vLLM object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

Pause = Literal["none", "new", "all"]
"""The scheduler's pause: ``none`` (batches run), ``new`` (no new request is admitted: a
drain), ``all`` (no batch runs: a hold)."""


class EngineCore(Protocol):
    """One engine core, as the coordinator drives it."""

    def collective_rpc(self, method: str, timeout: float | None = None,
                       args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
                       ) -> list[Any]:
        """Run ``method`` on every rank, in the same queue as the model steps."""

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop the prefix cache (and recompute the running requests' KV)."""

    def get_weight_version(self) -> str:
        """The weight version vLLM reports (on every response's spans)."""

    def set_weight_version(self, weight_version: str) -> None:
        """Label the weights (a step, ``inconsistent``, ``unknown``)."""

    def pause(self) -> Pause:
        """The scheduler's pause now."""

    def set_pause(self, state: Pause) -> None:
        """Set the scheduler's pause."""

    def has_unfinished_requests(self) -> bool:
        """Some request is running or waiting."""

    def lora_ids_in_use(self) -> set[int]:
        """The LoRA adapter ids of every unfinished request (running, waiting, preempted)."""


__all__ = ["EngineCore", "Pause"]

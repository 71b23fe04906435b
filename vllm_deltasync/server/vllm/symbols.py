"""One row of the vLLM surface table (``surface.py``): a symbol, how we touch it, why, and what
happens without it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Symbol:
    name: str
    """``module:Qualified.name``."""
    kind: str
    why: str
    without: str
    params: tuple[str, ...] = ()
    """Parameter names the call or the patch relies on (each must be accepted)."""
    attr: bool = False
    """An instance attribute (``self.<name> = ...``), not a ``def``."""
    private: bool = False
    """Not vLLM's public API (a leading underscore, or an internal module)."""
    also: tuple[str, ...] = ()
    """Attributes this row covers that vLLM sets on objects outside any class (the ``cpu_linear``
    kernel the CPU dispatch puts on a layer): no row of their own, checked through this one."""
    scope: str = "engine"
    """What a missing symbol refuses: ``engine`` (the extension: vLLM serves the loaded weights),
    ``drafter`` (only the speculative drafter's following; the policy follows) or ``lora``
    (only the LoRA adapters' following: the base model and the drafter follow)."""

    @property
    def module(self) -> str:
        return self.name.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.name.partition(":")[2]


__all__ = ["Symbol"]

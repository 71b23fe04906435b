"""vllm-deltasync: sparse bf16 weight deltas through an object-store bucket into vLLM."""

from __future__ import annotations

__version__ = "0.1.0"

"""Registers ``vllm-deltasync status`` (the cli discovers ``cli_<verb>`` modules); the verb
lives in :mod:`vllm_deltasync.status_cli`."""

from __future__ import annotations

from vllm_deltasync.status_cli import add_parser, run

__all__ = ["add_parser", "run"]

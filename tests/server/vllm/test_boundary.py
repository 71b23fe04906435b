"""The vLLM boundary holds: every vLLM attribute the package touches is a row of ``SURFACE``,
and only ``server/vllm/`` touches one (issue 34, item 4).

Read with ``ast`` (nothing here imports vLLM). An attribute is "touched" when the code reads or
writes ``obj.name`` or calls ``getattr``/``hasattr``/``setattr``/``delattr`` with the name
spelled out. What a vLLM attribute is, is decided by elimination: names the package defines
itself (functions, classes, methods, attributes it assigns, parameters), our ``_deltasync_``
marks, the attributes of Python's and torch's own types and of the standard library modules
the boundary uses are not vLLM's; what remains in ``server/vllm/`` must be a row of the table
(its last name, or one its row covers), and no module elsewhere may touch any name of the
table that the package does not define itself.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import queue
import threading
import types
from pathlib import Path

from vllm_deltasync.server.vllm.surface import SURFACE

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_deltasync"
BOUNDARY = PACKAGE / "server" / "vllm"

FOREIGN_NOT_VLLM = {"add_middleware"}
"""Attributes of other libraries' objects the boundary is handed (Starlette's app)."""


def _touched(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            out.add(node.args[1].value)
    return out


def _defined(paths: list[Path]) -> set[str]:
    """Names the package defines itself in ``paths``."""
    out: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    for part in ast.walk(target):
                        if isinstance(part, ast.Attribute):
                            out.add(part.attr)
                        elif isinstance(part, ast.Name):
                            out.add(part.id)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
    return out


def _not_vllm() -> set[str]:
    import torch

    names: set[str] = set(dir(builtins)) | FOREIGN_NOT_VLLM
    for kind in (str, bytes, dict, list, tuple, set, object, type, int, float):
        names |= set(dir(kind))
    for module in (types.FunctionType, types.AsyncGeneratorType, types.ModuleType,
                   torch, torch.nn, torch.nn.functional, torch.Tensor, torch.nn.Module,
                   torch.nn.Parameter, asyncio, asyncio.Task, contextlib, dataclasses, functools,
                   importlib, json, logging, logging.Logger, queue.Queue, threading):
        names |= set(dir(module))
    return names


def _rows() -> set[str]:
    return {s.qualname.split(".")[-1] for s in SURFACE} | {a for s in SURFACE for a in s.also}


SUBCLASSES = {PACKAGE / "trainer" / "weight_transfer.py"}
"""vLLM subclasses outside the boundary, imported only by vLLM's own loader (the documented
exception of tests/test_architecture.py): they are vLLM code by inheritance."""


def _modules(inside: bool) -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if ((BOUNDARY in p.parents) or p in SUBCLASSES) is inside
                  and "__pycache__" not in p.parts)


def _top_level(paths: list[Path]) -> set[str]:
    """Module-level functions and classes of ``paths`` (ours, wherever they live)."""
    return {n.name for p in paths for n in ast.parse(p.read_text(encoding="utf-8")).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_every_vllm_attribute_the_boundary_touches_is_a_row() -> None:
    ours = _defined(_modules(inside=False)) | _top_level(_modules(inside=True))
    missing = {}
    for path in _modules(inside=True):
        mine = _defined([path])
        names = {n for n in _touched(path) - _not_vllm() - ours - _rows()
                 if not n.startswith("_deltasync")}
        # a name the module defines for itself (a method of our class) is not vLLM's
        names -= {n for n in mine if n not in _rows()}
        if names:
            missing[path.relative_to(PACKAGE).as_posix()] = sorted(names)
    assert not missing, ("vLLM attributes touched without a row in server/vllm/surface.py "
                         f"(add one each: symbol, why, what happens without it): {missing}")


def test_no_module_outside_the_boundary_touches_a_vllm_attribute() -> None:
    ours = _defined(_modules(inside=False))
    vllm_only = _rows() - ours - _not_vllm()
    assert {"model_runner", "vllm_config", "weight_loader", "quant_method", "cpu_linear",
            "total_num_scheduled_tokens", "get_vocab_size", "moe_config"} <= vllm_only
    offenders = {}
    for path in _modules(inside=False):
        touched = _touched(path) & vllm_only
        if touched:
            offenders[path.relative_to(PACKAGE).as_posix()] = sorted(touched)
    assert not offenders, ("package code outside server/vllm/ touches vLLM objects by attribute "
                           f"(move it behind the boundary): {offenders}")


def test_the_check_catches_an_attribute_without_a_row(tmp_path: Path) -> None:
    """The scan itself: a vLLM-only name in a module is reported by both rules."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f(worker):\n    return worker.model_runner.input_batch\n")
    assert {"model_runner", "input_batch"} <= _touched(probe)
    assert "input_batch" not in _rows() and "model_runner" in _rows()

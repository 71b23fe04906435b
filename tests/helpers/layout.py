"""Where test modules live, what they import, which test paths the docs name: the scans behind
the test-layout rules of ``tests/test_architecture.py`` (issue 34, item 7).

The tests mirror the package: a test module lives in ``tests/<folder>/`` where ``<folder>`` is
a folder of ``vllm_deltasync/`` one of whose modules it imports (``tests/server/worker/`` for
``vllm_deltasync/server/worker/``), or in one of the cross-cutting folders of
:data:`CROSS_CUTTING`. Imports are read with ``ast``; a name imported from a package's
``__init__`` (``from vllm_deltasync import DeltaPublisher``) counts for the module that defines
it. Nothing here imports vLLM.
"""

from __future__ import annotations

import ast
import importlib
import re
import types
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PACKAGE = ROOT / "vllm_deltasync"

CROSS_CUTTING = {
    "": "the package as a whole (public API, architecture, the host's engine probes) and the "
        "package's top-level modules (vllm_deltasync/*.py)",
    "engine": "real vLLM engines (CPU build) following real buckets: every layer at once",
    "faults": "the fault matrix: misbehaving servers, planted secrets, hostile buckets, "
              "across stores, format, trainer, server and CLI",
    "monitoring": "metrics, status and Prometheus/Grafana deployment, end to end",
    "benchmarks": "the benchmark scripts of benchmarks/ (their own small-settings runs)",
}
"""Test folders that do not mirror one package folder, and why (docs/architecture.md, Tests)."""

NOT_TESTS = {"helpers", "startup", "data"}
"""Folders of tests/ that hold no test modules: shared helpers, the test processes'
``sitecustomize``, recorded buckets."""


def mirrored_folders() -> set[str]:
    """Every folder of the package, relative to it (``server/worker``)."""
    return {str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("__init__.py")
            if p.parent != PACKAGE}


def all_test_modules() -> list[Path]:
    """Every test module under tests/ (``test_*.py``), sorted."""
    return sorted(p for p in TESTS.rglob("test_*.py")
                  if p.relative_to(TESTS).parts[0] not in NOT_TESTS)


def folder_of(path: Path) -> str:
    """The test folder of ``path`` relative to tests/ (``""`` for tests/ itself)."""
    rel = path.parent.relative_to(TESTS)
    return "" if str(rel) == "." else str(rel)


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def _defining_module(module: str, name: str) -> str:
    """The package module that ``from module import name`` takes ``name`` from."""
    if _is_module(f"{module}.{name}"):
        return f"{module}.{name}"
    if module.startswith("vllm_deltasync.server.vllm"):
        return module  # the vLLM boundary: never imported here
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return module
    if isinstance(value, types.ModuleType):
        return value.__name__
    owner = getattr(value, "__module__", None)
    return owner if isinstance(owner, str) and owner.startswith("vllm_deltasync") else module


def _imports(path: Path) -> Iterator[tuple[str, list[str], int]]:
    """(module, names, level) of every import in ``path``, anywhere in it."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            yield node.module or "", [a.name for a in node.names], node.level
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], 0


def package_modules_imported(path: Path, *, through_helpers: bool = True) -> set[str]:
    """The package modules ``path`` imports (dotted), re-exports resolved to their modules;
    with ``through_helpers``, also those of the ``tests.helpers`` modules it imports (a test of
    the rank drives it through :class:`~tests.helpers.follow.Follower`)."""
    found: set[str] = set()
    for module, names, level in _imports(path):
        if through_helpers and module.startswith("tests.helpers"):
            helper = ROOT / Path(*module.split("."))
            helpers = [helper.with_suffix(".py")] if helper.with_suffix(".py").is_file() else [
                helper / f"{n}.py" for n in names if (helper / f"{n}.py").is_file()]
            for one in helpers:
                found |= package_modules_imported(one, through_helpers=False)
        if level or not (module == "vllm_deltasync" or module.startswith("vllm_deltasync.")):
            continue
        if names:
            found.update(_defining_module(module, n) for n in names)
        else:
            found.add(module)
    return found


def package_folder(dotted: str) -> str:
    """The package folder of a module: ``server/worker`` for ``vllm_deltasync.server.worker.poller``
    and for the package ``vllm_deltasync.server.worker`` itself; ``""`` for the top level."""
    parts = dotted.split(".")[1:]
    if parts and (PACKAGE / Path(*parts) / "__init__.py").is_file():
        return "/".join(parts)
    return "/".join(parts[:-1])


def misplaced() -> list[str]:
    """Test modules in a folder that neither mirrors a package folder they import from nor is
    cross-cutting, each with the folders that would fit."""
    mirrors = mirrored_folders()
    wrong = []
    for path in all_test_modules():
        folder = folder_of(path)
        if folder in CROSS_CUTTING:
            continue
        imported = {package_folder(m) for m in package_modules_imported(path)}
        if folder not in mirrors or folder not in imported:
            fits = sorted(f for f in imported if f in mirrors) or ["a cross-cutting folder"]
            wrong.append(f"tests/{path.relative_to(TESTS)} (fits: {', '.join(fits)})")
    return wrong


def tests_imported(path: Path) -> list[str]:
    """What ``path`` imports from tests/ other than tests.helpers: other test modules, a
    conftest, a sibling module (relative imports count)."""
    bad = []
    for module, names, level in _imports(path):
        if level:
            bad.append("." * level + module + (f" ({', '.join(names)})" if not module else ""))
        elif module == "tests" and names:
            bad.extend(f"tests.{n}" for n in names if n != "helpers")
        elif module.startswith("tests.") and not module.startswith("tests.helpers"):
            bad.append(module)
    return bad


_TEST_PATH = re.compile(r"(?<![\w/.])tests/[A-Za-z0-9_./*-]*[A-Za-z0-9_/*]")
DOC_FILES = ("README.md", "docs", "benchmarks", "examples", "scripts", "deploy", "tests",
             "vllm_deltasync", "pyproject.toml", "CONTRIBUTING.md")


def _text_files() -> Iterator[Path]:
    for name in DOC_FILES:
        top = ROOT / name
        if top.is_file():
            yield top
        elif top.is_dir():
            yield from (p for p in sorted(top.rglob("*"))
                        if p.suffix in {".md", ".py", ".toml", ".yml", ".yaml", ".sh", ".txt"}
                        and "data" not in p.relative_to(ROOT).parts)


def missing_test_paths() -> list[str]:
    """``tests/...`` paths named in docs, code and comments that do not exist (a glob such as
    ``tests/engine/test_lora_*.py``: that no file matches)."""
    missing = []
    for path in _text_files():
        for match in _TEST_PATH.finditer(path.read_text(encoding="utf-8", errors="replace")):
            named = match.group(0).rstrip("/.")
            if not (any(ROOT.glob(named)) if "*" in named else (ROOT / named).exists()):
                missing.append(f"{path.relative_to(ROOT)}: {named}")
    return sorted(set(missing))

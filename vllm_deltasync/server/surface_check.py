"""The vLLM surface, checked: every row of ``server/vllm/surface.py``'s table looked up in a
vLLM source tree, by ``ast`` (nothing here imports vLLM).

Used three ways:

- at engine start, against the installed vLLM (:func:`cached_problems`: the ``ast`` pass once
  per vLLM installation and table, its answer kept in a private file of the user's vLLM cache
  directory, checked for owner and mode before it is believed): a missing or changed symbol
  makes the extension refuse visibly while vLLM serves the loaded weights;
- by ``tests/server/vllm/test_surface.py``, against the installed vLLM;
- by ``scripts/check_vllm.py``, against any vLLM wheel, for the compatibility table of
  docs/extension.md.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from vllm_deltasync import failpoints
from vllm_deltasync.server.vllm.surface import SURFACE, Symbol, vllm_version


@dataclasses.dataclass(frozen=True)
class Finding:
    symbol: Symbol
    problem: str
    """Empty when the symbol is there as the table says."""

    @property
    def ok(self) -> bool:
        return not self.problem


SourceReader = Callable[[str], "tuple[str, bool] | None"]
"""A dotted module name -> (its source text, whether it is a package's ``__init__``), None
when the module does not exist."""


def installed_source(module: str) -> tuple[str, bool] | None:
    """The installed vLLM's source of ``module``, read from its file (vLLM is not imported)."""
    spec = importlib.util.find_spec("vllm") if module.split(".")[0] == "vllm" else None
    roots = list(getattr(spec, "submodule_search_locations", None) or ())
    for root in roots:
        base = Path(root).parent.joinpath(*module.split("."))
        for path, package in ((base / "__init__.py", True), (base.with_suffix(".py"), False)):
            with contextlib.suppress(OSError):
                return path.read_text(encoding="utf-8"), package
    return None


class _Index:
    """Parsed modules and the classes they define or import, for lookups through bases."""

    def __init__(self, read: SourceReader) -> None:
        self._read = read
        self._trees: dict[str, ast.Module | None] = {}
        self.packages: set[str] = set()

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            found = self._read(module)
            tree = None
            if found is not None:
                source, package = found
                if package:
                    self.packages.add(module)
                with contextlib.suppress(SyntaxError):
                    tree = ast.parse(source)
            self._trees[module] = tree
        return self._trees[module]

    def top(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """The module-level definition of ``name`` in ``module``, following re-exports."""
        tree = self.tree(module)
        if tree is None or depth > 6:
            return None
        body = [n for node in tree.body  # a name served by the module's __getattr__ is
                for n in ([node] if not isinstance(node, ast.If) else node.body)]  # declared
        for node in body:  # in ``if TYPE_CHECKING:`` (``vllm.platforms.current_platform``)
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name == name:
                return module, node
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _targets(node):
                return module, node
        for item in ast.walk(tree):
            if isinstance(item, ast.ImportFrom) and item.module:
                for alias in item.names:
                    if (alias.asname or alias.name) == name:
                        source = _resolve_relative(module, item, self)
                        return self.top(source, alias.name, depth + 1)
        return None

    def member(self, module: str, cls: ast.ClassDef, name: str, attr: bool,
               depth: int = 0) -> ast.AST | None:
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _targets(node):
                return node
        if attr:
            for item in ast.walk(cls):
                if isinstance(item, (ast.Assign, ast.AnnAssign)) and name in _self_targets(item):
                    return item
        if depth > 8:
            return None
        for base in cls.bases:
            base_name = base.id if isinstance(base, ast.Name) else (
                base.attr if isinstance(base, ast.Attribute) else None)
            if base_name is None:
                continue
            found = self.top(module, base_name)
            if found is not None and isinstance(found[1], ast.ClassDef):
                hit = self.member(found[0], found[1], name, attr, depth + 1)
                if hit is not None:
                    return hit
        return None


def _resolve_relative(module: str, node: ast.ImportFrom, index: _Index) -> str:
    if not node.level:
        return str(node.module)
    parts = module.split(".")
    base = parts if module in index.packages else parts[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join([*base, node.module] if node.module else base)


def _targets(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _self_targets(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    out = set()
    for t in targets:
        for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
            if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) \
                    and el.value.id == "self":
                out.add(el.attr)
    return out


def _accepts(fn: ast.FunctionDef | ast.AsyncFunctionDef, params: Iterable[str]) -> list[str]:
    a = fn.args
    names = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
    if a.kwarg is not None:
        return []
    return [p for p in params if p not in names]


def check_symbol(symbol: Symbol, index: _Index) -> Finding:
    if index.tree(symbol.module) is None:
        return Finding(symbol, f"module {symbol.module} not found")
    first, *rest = symbol.qualname.split(".")
    found = index.top(symbol.module, first)
    if found is None:
        return Finding(symbol, f"{first} not found in {symbol.module}")
    module, node = found
    for i, part in enumerate(rest):
        if not isinstance(node, ast.ClassDef):
            return Finding(symbol, f"{'.'.join([first, *rest[:i]])} is not a class")
        hit = index.member(module, node, part, attr=symbol.attr and i == len(rest) - 1)
        if hit is None:
            return Finding(symbol, f"{part} not found in {'.'.join([first, *rest[:i]])}")
        node = hit
    if symbol.params:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Finding(symbol, "not a function")
        missing = _accepts(node, symbol.params)
        if missing:
            return Finding(symbol, f"no parameter {', '.join(missing)}")
    return Finding(symbol, "")


def check(read: SourceReader = installed_source, symbols: Iterable[Symbol] = SURFACE, *,
          breaks: bool = True) -> list[Finding]:
    """Every symbol of the table looked up in the source ``read`` gives (see the module doc).
    The test failpoint ``surface_break`` makes the named entries fail, unless ``breaks`` is
    False."""
    index = _Index(read)
    symbols = list(symbols)
    broken = _broken(symbols) if breaks else set()
    return [Finding(symbol, BROKEN) if symbol.name in broken
            else check_symbol(symbol, index) for symbol in symbols]


BROKEN = "made to fail by the test failpoint surface_break"


def _broken(symbols: list[Symbol]) -> set[str]:
    """The names the failpoint ``surface_break`` makes fail among ``symbols`` (``*``: the
    first)."""
    names = {n for args in failpoints.armed("surface_break") for n in args if n}
    return {s.name for i, s in enumerate(symbols) if s.name in names or ("*" in names and i == 0)}


def problems(findings: Iterable[Finding] | None = None) -> list[str]:
    """One line per symbol that is not as the table says (empty: the surface holds)."""
    found = check() if findings is None else findings
    return [f"{f.symbol.name}: {f.problem}" for f in found if not f.ok]


_installed: list[str] | None = None
""":func:`cached_problems` of this process, before :data:`BREAK_ENV`."""


def cached_problems(scope: str = "engine") -> list[str]:
    """:func:`problems` of the symbols of ``scope`` (:attr:`Symbol.scope`) for the installed
    vLLM, the ``ast`` pass (about 0.5 s) done once per vLLM installation and table: kept in
    ``$VLLM_CACHE_ROOT/deltasync/`` (or ``~/.cache/vllm``), keyed by the vLLM version, its
    files' sizes and times, and the table (:func:`_file_cached`: read back only from a private
    directory and file of this user); and once per process. The failpoint ``surface_break``
    applies."""
    global _installed
    names = {s.name for s in SURFACE if s.scope == scope}
    broken = _broken(list(SURFACE))
    lines = [f"{s.name}: {BROKEN}" for s in SURFACE if s.name in broken and s.name in names]
    if _installed is None:
        _installed = _file_cached(lambda: problems(check(breaks=False)))
    return lines + [line for line in _installed if line.partition(": ")[0] in names]


def _file_cached(compute: Callable[[], list[str]]) -> list[str]:
    """``compute()``, kept in a file of the cache directory. The file is trusted only when it
    and its directory belong to this user, are not writable by anyone else and are not
    symbolic links (another user could otherwise plant an answer that hides a broken vLLM);
    anything else is ignored and computed again (nothing is written there either)."""
    key = hashlib.sha256(repr((vllm_version(), _stamp(), SURFACE)).encode()).hexdigest()[:16]
    root = Path(os.environ.get("VLLM_CACHE_ROOT") or Path.home() / ".cache" / "vllm")
    folder = root / "deltasync"
    path = folder / f"surface-{key}.json"
    with contextlib.suppress(OSError):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private(folder):
        return compute()
    if _private(path):
        with contextlib.suppress(OSError, ValueError):
            found = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(found, list) and all(isinstance(line, str) for line in found):
                return found
    found = compute()
    with contextlib.suppress(OSError):
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(found))
        os.replace(tmp, path)
    return found


def _private(path: Path) -> bool:
    """``path`` exists, is not a symbolic link, belongs to this user and nobody else may
    write it."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return (not stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _stamp() -> tuple[tuple[str, int, int], ...]:
    """Size and time of each vLLM file the table names (a reinstall changes the key)."""
    out = []
    spec = importlib.util.find_spec("vllm")
    for root in getattr(spec, "submodule_search_locations", None) or ():
        for module in sorted({s.module for s in SURFACE}):
            base = Path(root).parent.joinpath(*module.split("."))
            for path in (base / "__init__.py", base.with_suffix(".py")):
                with contextlib.suppress(OSError):
                    st = path.stat()
                    out.append((str(path), st.st_size, st.st_mtime_ns))
    return tuple(out)


__all__ = ["BROKEN", "Finding", "cached_problems", "check", "check_symbol", "installed_source",
           "problems"]

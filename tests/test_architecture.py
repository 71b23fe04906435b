"""docs/architecture.md lists every module of the package, and only the modules of
``server/vllm/`` (the vLLM boundary) import vLLM.

The module table is parsed from the doc (rows whose first cell is a backticked ``*.py`` path,
relative to ``vllm_deltasync/``) and compared with the files; vLLM imports are found with
``ast`` in each module's source, so nothing here imports vLLM.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

from tests.helpers import layout

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vllm_deltasync"
DOC = ROOT / "docs" / "architecture.md"
GLUE = "server/vllm/"
"""The vLLM boundary: the only folder whose modules import vLLM (issue 24, item 1)."""
SUBCLASSES_OF_VLLM = {
    "server/vllm/weight_transfer.py": "the receiver of backend 'deltasync' subclasses vLLM's "
                                      "WeightTransferEngine; only vLLM's lazy factory loader "
                                      "imports it (registered by module path in plugin.py)",
    "trainer/weight_transfer.py": "the trainer side subclasses vLLM's "
                                  "TrainerWeightTransferEngine and TrainerInitInfo; imported "
                                  "only by a trainer that picks backend 'deltasync'",
}
"""The only modules that import vLLM at module level (issue 25, item 4): each defines a
subclass of a vLLM class, which needs vLLM's class when the module runs, and nothing in the
package imports them (``import vllm_deltasync`` and every other module still import without
vLLM)."""
_ROW = re.compile(r"^\|\s*`([^`]+\.py)`\s*\|(.*)$")


def package_modules(include_markers: bool = False) -> set[str]:
    """Every ``*.py`` of the package, relative to it (``server/worker/poller.py``)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if "__pycache__" in rel:
            continue
        if not include_markers and path.name in ("__init__.py", "__main__.py"):
            continue
        found.add(rel)
    return found


def doc_table() -> dict[str, list[str]]:
    """module -> the other cells of its row, from the "## Modules" section of the doc."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"^## Modules\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"{DOC} has no '## Modules' section"
    rows: dict[str, list[str]] = {}
    for line in match.group(1).splitlines():
        row = _ROW.match(line.strip())
        if row is None:
            continue
        module = row.group(1)
        assert module not in rows, f"{module} has two rows in the table of {DOC.name}"
        rows[module] = [c.strip() for c in row.group(2).rstrip("|").split("|")]
    assert rows, f"no module rows found in the table of {DOC.name}"
    return rows


def _is_vllm(name: str | None) -> bool:
    return name is not None and (name == "vllm" or name.startswith("vllm."))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_vllm(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(_is_vllm(a.name) for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and _is_vllm(node.module)
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        name = node.args[0].value
        called = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
        return isinstance(name, str) and _is_vllm(name) and called in ("import_module",
                                                                        "__import__")
    return False


def vllm_imports(source: str, *, module_level_only: bool) -> list[int]:
    """Line numbers of ``import vllm...`` / ``from vllm... import`` (and
    ``importlib.import_module("vllm...")``). Module level: statements run at import time,
    i.e. not inside a function and not under ``if TYPE_CHECKING:``."""
    lines: list[int] = []

    def visit(node: ast.AST) -> None:
        if module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda)):
            return
        if module_level_only and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if _imports_vllm(node):
            lines.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    with warnings.catch_warnings():  # a module's own invalid escapes are not this test's business
        warnings.simplefilter("ignore")
        tree = ast.parse(source)
    visit(tree)
    return lines


def test_every_module_has_one_row_and_every_row_a_module() -> None:
    documented = set(doc_table())
    missing = sorted(package_modules() - documented)
    assert not missing, (
        f"modules missing from the table in docs/architecture.md: {missing}; add a row each "
        "(module | where it runs | role | imports vLLM?)")
    stale = sorted(documented - package_modules(include_markers=True))
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"


def test_rows_have_four_cells_and_a_place_to_run() -> None:
    places = ("trainer process", "any process", "worker main thread", "worker poller thread",
              "engine-core busy loop", "CLI", "API server process")
    for module, cells in doc_table().items():
        assert len(cells) == 3, f"{module}: row needs module | where | role | imports vLLM?"
        where, role, imports = cells
        assert any(p in where for p in places), f"{module}: 'where it runs' is {where!r}"
        assert role, f"{module}: empty role"
        assert imports.strip("*").lower().startswith(("no", "yes")), f"{module}: {imports!r}"


def test_only_the_boundary_imports_vllm() -> None:
    """Outside ``server/vllm/`` no module imports vLLM, not even inside a function; inside it,
    never at module level (the package imports where vLLM does not)."""
    offenders = {}
    for module in sorted(package_modules(include_markers=True)):
        if module in SUBCLASSES_OF_VLLM:
            continue
        source = (PACKAGE / module).read_text(encoding="utf-8")
        lines = vllm_imports(source, module_level_only=module.startswith(GLUE))
        if lines:
            offenders[module] = lines
    assert not offenders, (
        f"vLLM imported outside {GLUE}, or at module level inside it (module: lines): "
        f"{offenders}; reach vLLM through {GLUE} (and list the symbol in its surface.py)")


def test_table_says_which_modules_import_vllm() -> None:
    """A row that says "no" means no vLLM import at all, not even inside a function."""
    for module, (_, _, imports) in doc_table().items():
        lines = vllm_imports((PACKAGE / module).read_text(encoding="utf-8"),
                             module_level_only=False)
        says_yes = imports.strip("*").lower().startswith("yes")
        assert says_yes == bool(lines), (
            f"{module}: the table says imports vLLM = {imports!r}, the source has vLLM imports "
            f"at lines {lines}")
    assert doc_table()["server/vllm/plugin.py"][2].strip("*").lower().startswith("yes")


def test_only_the_named_subclass_modules_import_vllm_at_module_level() -> None:
    """:data:`SUBCLASSES_OF_VLLM` is exact: each imports vLLM at module level (else it does
    not belong there), no other package module imports one of them, and its table row says
    so."""
    for module in SUBCLASSES_OF_VLLM:
        source = (PACKAGE / module).read_text(encoding="utf-8")
        assert vllm_imports(source, module_level_only=True), f"{module} needs no exception"
        assert doc_table()[module][2].strip("*").lower().startswith("yes, at module level")
    names = {"vllm_deltasync." + m[:-3].replace("/", ".") for m in SUBCLASSES_OF_VLLM}
    for module in sorted(package_modules(include_markers=True)):
        imported = {".".join(["vllm_deltasync", *t.rstrip("/").removesuffix(".py").split("/")])
                    for t in _imports_of(PACKAGE / module)}
        assert not imported & names, f"{module} imports {imported & names}: only vLLM may"


def test_ast_scan_finds_what_it_should() -> None:
    src = textwrap.dedent("""
        import os
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from vllm.config import VllmConfig
        try:
            import vllm.envs as envs
        except ImportError:
            envs = None
        def f():
            from vllm import LLM
        import vllm_deltasync
    """)
    assert vllm_imports(src, module_level_only=True) == [7]
    assert vllm_imports(src, module_level_only=False) == [5, 7, 11]


def test_package_imports_without_vllm() -> None:
    """``import vllm_deltasync`` (and every module, the boundary's included: they import vLLM
    inside functions only) works where vLLM cannot be imported: ``sys.modules["vllm"] = None``
    makes any ``import vllm`` raise."""
    modules = sorted(
        "vllm_deltasync." + m[:-3].replace("/", ".").removesuffix(".__init__")
        for m in package_modules(include_markers=True)
        if not m.endswith("__main__.py") and m != "__init__.py" and m not in SUBCLASSES_OF_VLLM
    )
    script = textwrap.dedent(f"""
        import importlib, sys
        sys.modules["vllm"] = None
        import vllm_deltasync
        assert vllm_deltasync.DeltaPublisher and vllm_deltasync.BucketReader
        assert "vllm_deltasync.server.extension" not in sys.modules  # DeltaSyncExtension is lazy
        assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules
                       if sys.modules[m] is not None), "vllm got imported"
        for name in {modules!r}:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:  # an optional extra (aiobotocore, ...) missing
                if exc.name == "vllm" or (exc.name or "").startswith("vllm."):
                    raise
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


#: folder -> the folders (and single modules) its code may import; "" is the package's top level
#: (errors, config, _loop, _urls, ...). The data path reads downward: cli and trainer and server
#: use format and stores; format uses stores; stores know nothing of the format but its names.
ALLOWED_IMPORTS: dict[str, set[str]] = {
    "stores": {"", "format/layout.py"},
    "format": {"", "stores"},
    "trainer": {"", "format", "stores"},
    "server": {"", "format", "stores"},
    "cli": {"", "format", "stores", "trainer", "server/targets.py"},
}

#: Inside ``server/`` (issue 34): module or folder -> what of ``server/`` it may import (its own
#: folder always). The rank's code (worker) and the engine core's (engine) know nothing of each
#: other nor of vLLM's glue; the glue (vllm) builds the worker's typed view and starts the
#: engine's coordinator, and never reaches back into the extension; the extension is the edge
#: that joins vLLM's worker to the rank.
SERVER_IMPORTS: dict[str, set[str]] = {
    "server/targets.py": set(),
    "server/messages.py": set(),
    "server/metrics.py": {"server/messages.py", "server/targets.py", "server/endpoint.py"},
    "server/endpoint.py": {"server/metrics.py"},
    "server/surface_check.py": {"server/vllm/surface.py"},
    "server/api/": {"server/targets.py"},
    "server/worker/": {"server/messages.py", "server/targets.py", "server/metrics.py"},
    "server/engine/": {"server/messages.py", "server/targets.py", "server/metrics.py",
                       "server/endpoint.py"},
    "server/vllm/": {"server/messages.py", "server/targets.py", "server/surface_check.py",
                     "server/worker/", "server/engine/", "server/api/"},
    "server/extension.py": {"server/targets.py", "server/messages.py", "server/surface_check.py",
                            "server/vllm/", "server/worker/"},
}


def _server_rule(rel: str) -> tuple[str, set[str]] | None:
    for key, allowed in SERVER_IMPORTS.items():
        if rel == key or (key.endswith("/") and rel.startswith(key)):
            return key, allowed
    return None


def test_the_server_folders_import_one_way() -> None:
    wrong = []
    for rel in sorted(package_modules(include_markers=True)):
        if not rel.startswith("server/") or rel == "server/__init__.py":
            continue
        rule = _server_rule(rel)
        assert rule is not None, f"{rel} has no rule in SERVER_IMPORTS"
        key, allowed = rule
        for target in sorted(_imports_of(PACKAGE / rel)):
            if not target.startswith("server/") or target.startswith(key):
                continue
            if not any(target == a or (a.endswith("/") and target.startswith(a)) for a in allowed):
                wrong.append(f"{rel} imports {target}")
    assert not wrong, "imports against server/'s folder rules:\n" + "\n".join(wrong)


def test_no_import_cycle_in_the_server() -> None:
    """Imports anywhere in a module count (inside functions too)."""
    graph = {rel: {t for t in _imports_of(PACKAGE / rel) if t.startswith("server/")
                   and t.endswith(".py")}
             for rel in package_modules() if rel.startswith("server/")}
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in graph.get(node, ()):
            if nxt in path:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif len(path) < 40:
                visit(nxt, [*path, nxt])

    for start in graph:
        visit(start, [start])
    assert not cycles, "import cycles in server/:\n" + "\n".join(sorted(set(cycles))[:10])


MAX_LINES = 520
"""No module over ~500 lines (issue 34, item 6): 520 is where "about" ends."""


def test_no_module_is_over_the_size_a_reader_can_hold() -> None:
    big = {rel: n for rel in package_modules(include_markers=True)
           if (n := len((PACKAGE / rel).read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them): {big}"


def test_failpoints_are_read_in_one_place() -> None:
    """Every failpoint goes through ``failpoints.armed`` (one variable, one format); no module
    reads a ``DELTASYNC_TEST_*`` variable or names a module to import from the environment."""
    offenders = []
    for rel in sorted(package_modules(include_markers=True)):
        text = (PACKAGE / rel).read_text(encoding="utf-8")
        if rel != "failpoints.py" and ("DELTASYNC_TEST" in text or "DELTASYNC_FAILPOINTS" in text):
            offenders.append(rel)
        if "importlib.import_module(os.environ" in text or "ENGINE_HOOK" in text:
            offenders.append(rel)
    assert not offenders, f"test machinery outside failpoints.py: {offenders}"


def test_tests_arm_failpoints_through_the_one_variable() -> None:
    """A test that still sets a retired ``DELTASYNC_TEST_*`` variable arms nothing: its failure
    path silently stops running (test_packed and test_moe did, until this check). Only the
    red-team test of the retired engine hook names one, to show it does nothing."""
    tests = PACKAGE.parent / "tests"
    offenders = sorted(str(p.relative_to(tests)) for p in tests.rglob("*.py")
                       if p.name not in {"test_architecture.py", "test_red_team_server.py"}
                       and '"DELTASYNC_TEST_' in p.read_text(encoding="utf-8"))
    assert not offenders, f"retired DELTASYNC_TEST_* variables set (use failpoints.env): {offenders}"


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (never run)."""
    out: list[ast.AST] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        out.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _imports_of(path: Path) -> set[str]:
    """Package modules ``path`` imports (anywhere in it, but for type checking), as paths
    relative to the package (``from vllm_deltasync.server import targets``: the module)."""
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module.split(".")
            names = [node.module]
            if base[0] == "vllm_deltasync" and (PACKAGE / Path(*base[1:])).is_dir():
                subs = [".".join([*base, a.name]) for a in node.names]
                names = [n for n in subs if (PACKAGE / Path(*n.split(".")[1:])).is_dir()
                         or (PACKAGE / Path(*n.split(".")[1:])).with_suffix(".py").is_file()]
                names = names or [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] != "vllm_deltasync" or len(parts) == 1:
                continue
            rest = parts[1:]
            if (PACKAGE / Path(*rest)).is_dir():
                found.add("/".join(rest) + "/")
            else:
                found.add("/".join(rest) + ".py")
    return found


def _against(rules: dict[str, set[str]]) -> list[str]:
    wrong = []
    for rel in sorted(package_modules(include_markers=True)):
        folder = rel.split("/")[0] if "/" in rel else ""
        if folder not in rules:
            continue  # the top level re-exports lazily
        allowed = rules[folder] | {folder}
        for target in sorted(_imports_of(PACKAGE / rel)):
            target_folder = target.split("/")[0] if "/" in target else ""
            if target_folder not in allowed and target.rstrip("/") not in allowed:
                wrong.append(f"{rel} imports {target}")
    return wrong


def test_imports_go_one_direction_between_folders() -> None:
    wrong = _against(ALLOWED_IMPORTS)
    assert not wrong, "imports against the direction in docs/architecture.md:\n" + "\n".join(wrong)


def test_the_import_rule_catches_a_wrong_import() -> None:
    """The scan itself: with stricter rules, the imports that exist are reported."""
    assert "stores/nodecache.py imports format/layout.py" in _against({"stores": {""}})
    assert any(line.startswith("server/") and "format/reader.py" in line
               for line in _against({"server": {"", "stores"}}))


# -- the tests mirror the package (issue 34, item 7; docs/architecture.md, Tests) ---------------


def test_every_test_module_is_in_the_folder_of_what_it_tests() -> None:
    wrong = layout.misplaced()
    assert not wrong, ("test modules outside the folder that mirrors what they test (move them, "
                       "or name a cross-cutting folder in tests/helpers/layout.py and "
                       "docs/architecture.md, Tests):\n" + "\n".join(wrong))


def test_the_layout_scan_sees_what_a_test_imports() -> None:
    """The scan itself: a re-export counts for its defining module, a helper for what it wraps,
    and a module in the wrong folder is reported with the folders that fit."""
    tests = layout.TESTS
    assert "vllm_deltasync.trainer.publisher" in layout.package_modules_imported(
        tests / "trainer" / "test_publisher.py")  # from vllm_deltasync import DeltaPublisher
    assert "vllm_deltasync.server.worker.poller" in layout.package_modules_imported(
        tests / "server" / "worker" / "test_discovery_limits.py")  # through tests.helpers.follow
    assert layout.package_folder("vllm_deltasync.server.worker.poller") == "server/worker"
    assert layout.package_folder("vllm_deltasync.server.worker") == "server/worker"
    assert layout.package_folder("vllm_deltasync._jit") == ""
    assert layout.mirrored_folders() >= {"format", "stores", "trainer", "cli", "server",
                                         "server/worker", "server/engine", "server/api"}


def test_the_cross_cutting_folders_are_the_documented_ones() -> None:
    section = DOC.read_text(encoding="utf-8").split("\n## Tests\n", 1)[1]
    documented = set(re.findall(r"^\| `tests/([a-z_]+)/` \|", section, re.MULTILINE))
    assert documented == set(layout.CROSS_CUTTING) - {""}
    assert all((layout.TESTS / name).is_dir() for name in documented)


def test_no_test_module_imports_another() -> None:
    """Test modules, conftests and the scripts tests run in a child (tests/engine/fresh_engine.py)
    import from tests/ only ``tests.helpers`` (a conftest holds fixtures built from it);
    helpers import only helpers."""
    modules = [p for p in sorted(layout.TESTS.rglob("*.py"))
               if p.relative_to(layout.TESTS).parts[0] not in {"helpers", "data"}]
    offenders = {str(p.relative_to(layout.TESTS)): bad for p in modules
                 if (bad := layout.tests_imported(p))}
    for helper in sorted((layout.TESTS / "helpers").glob("*.py")):
        bad = [m for m in layout.tests_imported(helper) if not m.startswith(".")]
        if bad:
            offenders[str(helper.relative_to(layout.TESTS))] = bad
    assert not offenders, f"imports of test modules or conftests (move to tests/helpers/): {offenders}"


def test_the_import_scan_sees_a_test_importing_a_test(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text("from .conftest import x\nfrom tests.server import test_a\n"
                      "import tests.format.test_b\nfrom tests import helpers\n"
                      "from tests.helpers.net import free_port\n")
    assert layout.tests_imported(sample) == [".conftest", "tests.server", "tests.format.test_b"]


def test_every_test_path_named_in_the_docs_exists() -> None:
    missing = layout.missing_test_paths()
    assert not missing, "tests/... paths named but not there (moved? update the text):\n" + \
        "\n".join(missing)

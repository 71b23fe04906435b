"""The ``vllm.general_plugins`` entry point can never break vLLM (issue 24, item 2).

vLLM calls general plugins without a ``try`` in every process it starts, so an exception in
``register_plugin`` would stop every vLLM process of the environment. In a child process with
the real vLLM installed, each vLLM symbol we patch on a class or module (the ``patched`` rows of
``server/vllm/surface.py``) is removed in turn: the entry point returns without raising, leaves
that patch out whole, installs the others, and records one line naming the symbol and the vLLM
version, which an engine naming the extension answers as its refusal. The worker's quiet-reads
patch (installed by ``deltasync_start``) and the hand-over of the HTTP endpoint plugin are left
out without a refusal (the weights follow as usual). With the surface check made to
fail, the engine core's refusal line names the symbol and the version.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers.engines import requires_vllm
from vllm_deltasync.server.vllm.plugin import PATCHES
from vllm_deltasync.server.vllm.surface import SURFACE

REPO = Path(__file__).resolve().parents[2]

#: (module, owner, attribute, the plugin patch it belongs to or "" for the worker's)
SYMBOLS = [
    ("vllm.v1.engine.core", "EngineCore", "__init__", "_patch_engine_core"),
    ("vllm.v1.engine.core", "EngineCoreProc", "_process_input_queue", "_patch_engine_core"),
    ("vllm.model_executor.layers.utils", "", "dispatch_cpu_unquantized_gemm", "_patch_cpu_gemm"),
    ("vllm.v1.executor.multiproc_executor", "WorkerProc", "_execute_worker_rpc", ""),
    ("vllm.plugins", "", "load_endpoint_plugins", "_hand_endpoint_plugin"),
]
#: Patches whose absence refuses nothing: the weights follow as usual (only a feature is off).
QUIET = ("", "_hand_endpoint_plugin")

CHILD = textwrap.dedent('''
    import importlib, json, os, sys
    cases = json.loads(sys.argv[1])
    from vllm_deltasync.server.vllm import engine, guard, plugin, worker

    def owner(module, cls):
        m = importlib.import_module(module)
        return getattr(m, cls) if cls else m

    keep = {(m, c, a): getattr(owner(m, c), a) for m, c, a, _ in cases}

    def restore():
        for (m, c, a), v in keep.items():
            setattr(owner(m, c), a, v)

    def installed():
        core = importlib.import_module("vllm.v1.engine.core")
        utils = importlib.import_module("vllm.model_executor.layers.utils")
        proc = importlib.import_module("vllm.v1.executor.multiproc_executor")
        plugins = importlib.import_module("vllm.plugins")
        return {
            "_hand_endpoint_plugin": bool(getattr(
                getattr(plugins, "load_endpoint_plugins", None), "_deltasync_patched", False)),
            "_patch_engine_core": any(
                getattr(f, "_deltasync_patched", False)
                for f in (core.EngineCore.__init__,
                          vars(core.EngineCoreProc).get("_process_input_queue"))),
            "_patch_cpu_gemm": bool(getattr(getattr(utils, "dispatch_cpu_unquantized_gemm", None),
                                            "_deltasync_patched", False)),
            "": bool(getattr(getattr(proc.WorkerProc, "_execute_worker_rpc", None),
                             "_deltasync_quiet", False)),
        }

    results = []
    for module, cls, attr, patch in cases:
        restore()
        guard.PLUGIN_REFUSALS.clear()
        o = owner(module, cls)
        delattr(o, attr)
        inherited = attr == "__init__"  # object.__init__ is still there: patched as is
        error = None
        try:
            plugin.register_plugin()
            worker.quiet_status_reads()
        except BaseException as exc:  # what vLLM would die of
            error = f"{type(exc).__name__}: {exc}"
        results.append({"case": [module, cls, attr, patch], "error": error,
                        "inherited": inherited, "refusals": list(guard.PLUGIN_REFUSALS),
                        "installed": installed(), "surface": engine.surface_refusal()})
    restore()
    guard.PLUGIN_REFUSALS.clear()
    os.environ["DELTASYNC_FAILPOINTS"] = "surface_break=" + sys.argv[2]
    broken = engine.surface_refusal()
    print("RESULTS " + json.dumps({"cases": results, "broken": broken}))
''')


def test_at_most_five_patches_each_a_table_row_named_once() -> None:
    """Issue 34: at most five class- or module-level patches of vLLM, the plugin's list is the
    table's ``patched`` rows, and this test removes each of them in turn below."""
    patched = {s.name for s in SURFACE if s.kind == "patched"}
    assert len(PATCHES) <= 5 and set(PATCHES) == patched
    assert {f"{m}:{c + '.' if c else ''}{a}" for m, c, a, _ in SYMBOLS} == patched
    assert len({s.name for s in SURFACE}) == len(SURFACE)
    for s in SURFACE:
        assert s.kind in ("patched", "wrapped", "called", "read", "subclassed"), s
        assert s.why and s.without, s


@requires_vllm
def test_each_missing_symbol_leaves_its_patch_out_and_vllm_unbroken() -> None:
    target = "vllm.v1.engine.core:EngineCoreProc._handle_client_request"
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(SYMBOLS), target], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    out = json.loads(line[len("RESULTS "):])
    results = out["cases"]
    assert len(results) == len(SYMBOLS)
    for r in results:
        module, cls, attr, patch = r["case"]
        assert r["error"] is None, r  # the entry point returned: vLLM starts
        if r["inherited"]:
            # without its own override the name resolves to a base class's: patched as is
            assert r["refusals"] == [] and all(r["installed"].values()), r
            continue
        others = {name: ok for name, ok in r["installed"].items() if name != patch}
        assert all(others.values()), r  # every other patch is in
        assert not r["installed"][patch], r  # this one is left out
        if patch in QUIET:  # the worker's quiet reads, the HTTP headers: nothing refuses
            assert r["refusals"] == [] and r["surface"] is None, r
            continue
        assert len(r["refusals"]) == 1, r  # one line, for the one patch that could not go in
        [refusal] = r["refusals"]
        assert attr in refusal and "vLLM " in refusal and "\n" not in refusal, refusal
        assert refusal in (r["surface"] or ""), r  # an engine naming the extension refuses
    broken = out["broken"]
    assert broken and target in broken and "vLLM " in broken and "docs/extension.md" in broken

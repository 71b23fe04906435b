"""The ``vllm.general_plugins`` entry point can never break vLLM (issue 24, item 2, first part).

vLLM calls general plugins without a ``try`` in every process it starts, so an exception in
``register_plugin`` would stop every vLLM process of the environment. In a child process with
the real vLLM installed, each vLLM symbol the plugin patches is removed in turn: the entry point
returns without raising, leaves that patch out whole (nothing half-installed), installs the
others, and records one line naming the symbol and the vLLM version, which a worker of an
engine naming the extension answers as its refusal (``deltasync_start``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.engine.conftest import requires_vllm

REPO = Path(__file__).resolve().parents[2]

#: (module, owner or "" for a module attribute, attribute, the patch it belongs to)
SYMBOLS = [
    ("vllm.model_executor.layers.utils", "", "dispatch_cpu_unquantized_gemm", "_patch_cpu_gemm"),
    ("vllm.v1.engine.core", "EngineCoreProc", "run_busy_loop", "_patch_engine_core"),
    ("vllm.v1.engine.core", "DPEngineCoreProc", "run_busy_loop", "_patch_engine_core"),
    ("vllm.v1.engine.core", "EngineCoreProc", "_handle_client_request", "_patch_engine_core"),
    ("vllm.v1.engine.core", "EngineCoreProc", "_process_engine_step", "_patch_engine_core"),
    ("vllm.v1.engine.core", "EngineCore", "shutdown", "_patch_engine_core"),
    ("vllm.v1.engine.core_client", "InprocClient", "get_output", "_patch_inproc_client"),
    ("vllm.v1.engine.core_client", "InprocClient", "collective_rpc", "_patch_inproc_client"),
]

CHILD = textwrap.dedent('''
    import importlib, json, sys
    cases = json.loads(sys.argv[1])
    from vllm_deltasync.server import extension as ext

    def owner(module, cls):
        m = importlib.import_module(module)
        return getattr(m, cls) if cls else m

    def snapshot():
        keep = {}
        for module, cls, _, _ in cases:
            o = owner(module, cls)
            keep[(module, cls)] = (o, dict(vars(o)) if cls else None)
        for module, attr in (("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm"),):
            keep[(module, attr)] = (owner(module, ""), getattr(owner(module, ""), attr))
        return keep

    def restore(keep):
        for (module, name), (o, saved) in keep.items():
            if isinstance(saved, dict):
                for k in list(vars(o)):
                    if k not in saved:
                        delattr(o, k)
                for k, v in saved.items():
                    if k not in ("__dict__", "__weakref__"):
                        try:
                            setattr(o, k, v)
                        except (AttributeError, TypeError):
                            pass
            else:
                setattr(o, name, saved)

    keep = snapshot()
    results = []
    for module, cls, attr, patch in cases:
        restore(keep)
        ext.PLUGIN_REFUSALS.clear()
        o = owner(module, cls)
        delattr(o, attr)
        inherited = hasattr(o, attr)  # a base class still has one: nothing is missing
        error = None
        try:
            ext.register_plugin()
        except BaseException as exc:  # what vLLM would die of
            error = f"{type(exc).__name__}: {exc}"
        core = importlib.import_module("vllm.v1.engine.core")
        client = importlib.import_module("vllm.v1.engine.core_client")
        utils = importlib.import_module("vllm.model_executor.layers.utils")
        installed = {
            "_patch_engine_core": bool(getattr(core.EngineCoreProc, "_deltasync_patched", False)),
            "_patch_inproc_client": bool(getattr(client.InprocClient, "_deltasync_patched", False)),
            "_patch_cpu_gemm": bool(getattr(getattr(utils, "dispatch_cpu_unquantized_gemm", None),
                                            "_deltasync_patched", False)),
        }
        half = {
            # a patch left out must not have replaced any of its symbols
            "_patch_engine_core": any(getattr(getattr(core, c), a, None) is not None
                                      and getattr(getattr(core, c), a).__name__.startswith("patched")
                                      for c, a in (("EngineCoreProc", "run_busy_loop"),
                                                   ("DPEngineCoreProc", "run_busy_loop"),
                                                   ("EngineCore", "shutdown"))),
        }
        results.append({"case": [module, cls, attr, patch], "error": error, "inherited": inherited,
                        "refusals": list(ext.PLUGIN_REFUSALS), "installed": installed,
                        "half": half})
    print("RESULTS " + json.dumps(results))
''')


@requires_vllm
def test_each_missing_symbol_leaves_its_patch_out_and_vllm_unbroken() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(SYMBOLS)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    results = json.loads(line[len("RESULTS "):])
    assert len(results) == len(SYMBOLS)
    assert sum(not r["inherited"] for r in results) >= 5  # most removals leave a hole
    for r in results:
        module, cls, attr, patch = r["case"]
        assert r["error"] is None, r  # the entry point returned: vLLM starts
        if r["inherited"]:
            # without its own override the name resolves to a base class's: patched as is
            assert r["refusals"] == [] and all(r["installed"].values()), r
            continue
        assert len(r["refusals"]) == 1, r  # one line, for the one patch that could not be installed
        [refusal] = r["refusals"]
        assert attr in refusal and "vLLM " in refusal and "\n" not in refusal, refusal
        assert not r["installed"][patch], r  # left out ...
        assert all(ok for name, ok in r["installed"].items() if name != patch), r  # ... only it
        if patch == "_patch_engine_core":
            assert not r["half"]["_patch_engine_core"], r  # ... whole

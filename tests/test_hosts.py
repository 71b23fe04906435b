"""The test run on whatever host it is given (issue 34, item 1; README, Development: hosts).

* every child Python of a test run starts with tests/startup/sitecustomize.py, which asks
  Linux for AMX tiles as the test process did, and still runs a ``sitecustomize`` it hides;
* the host is named by kind from its CPU flags (the three kinds seen so far);
* a probe killed by SIGILL (a child's, faulthandler's frames and all) gives a skip reason naming
  the host, the signal and the frame it died in; any other failure gives none (the tests fail and
  say why);
* a stock engine of the toy Llama runs here, without AMX, where vLLM selects no AMX kernel
  (skipped where AMX is advertised: there the probe's answer is what decides).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.engines import requires_vllm
from tests.helpers.hosts import (
    AMX_TILES,
    HOST,
    HOST_FLAGS,
    REPO,
    STARTUP,
    EngineProbe,
    cpu_flags,
    describe_host,
    engine_probe,
)


def _child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60, check=False)


def test_every_child_python_asks_for_amx_tiles_as_the_test_process_did() -> None:
    """A child started from the test process, and its own child started the way vLLM's CPU
    platform starts engine cores and workers (multiprocessing, ``spawn``)."""
    module = "__import__('sys').modules['sitecustomize']"
    ask = f"[{module}.__file__, {module}.request_amx_tiles()]"
    proc = _child("import json, multiprocessing\n"
                  "if __name__ == '__main__':\n"
                  "    with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
                  f"        spawned = pool.apply(eval, ({ask!r},))\n"
                  f"    print(json.dumps([{ask}, spawned]))\n")
    assert proc.returncode == 0, proc.stderr
    for path, answer in json.loads(proc.stdout):
        assert Path(path) == STARTUP / "sitecustomize.py"
        assert answer == AMX_TILES


def test_a_hidden_sitecustomize_still_runs(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['HIDDEN_RAN'] = '1'\n")
    proc = _child("import os; print(os.environ.get('HIDDEN_RAN'))",
                  PYTHONPATH=os.pathsep.join([str(STARTUP), str(tmp_path), str(REPO)]))
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr


@pytest.mark.parametrize(("flags", "tiles", "kind"), [
    ("fpu avx2 fma bmi2", None, "AVX2 only, no AVX-512"),
    ("avx2 avx512f avx512bw avx512_bf16 avx512_vnni", None, "AVX-512 without AMX"),
    ("avx2 avx512f avx512bw", None, "AVX-512 without AMX, no avx512_bf16"),
    ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8", True,
     "AVX-512 with AMX (tile data granted)"),
    ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8", False,
     "AVX-512 with AMX (tile data refused by Linux)"),
])
def test_the_host_is_named_by_kind(flags: str, tiles: bool | None, kind: str) -> None:
    cpuinfo = f"processor\t: 0\nvendor_id\t: X\nflags\t\t: {flags}\nbugs\t\t: spectre\n"
    assert describe_host(cpu_flags(cpuinfo), tiles) == kind


def test_only_a_cpu_trap_is_a_reason_to_skip() -> None:
    trap = ("import faulthandler, os, signal\n"
            "faulthandler.enable()\n"
            "def kernel():\n"
            "    os.kill(os.getpid(), signal.SIGILL)\n"
            "kernel()\n")
    proc = _child(trap)
    assert proc.returncode == -signal.SIGILL, (proc.returncode, proc.stderr)
    reason = EngineProbe("draft_model", proc.returncode, proc.stderr).skip_reason
    assert reason is not None
    assert HOST in reason and "SIGILL in kernel (<string>:4)" in reason and "draft" in reason
    assert EngineProbe("toy", 1, "Traceback: RuntimeError").skip_reason is None
    assert EngineProbe("toy", None, "").skip_reason is None  # a hang fails the tests instead
    assert EngineProbe("toy", 0, "PROBE {}").skip_reason is None


@requires_vllm
@pytest.mark.engine
def test_a_stock_toy_engine_runs_where_no_amx_is_advertised() -> None:
    if "amx_tile" in HOST_FLAGS:
        pytest.skip(f"this host ({HOST}) advertises AMX: the probe's answer decides there")
    probe = engine_probe("toy")
    assert probe.returncode == 0, probe.log
    assert '"kind": "toy"' in probe.log

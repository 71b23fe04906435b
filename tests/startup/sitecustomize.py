"""Run at the start of every Python process of a test run: asks Linux for AMX tile data where
the CPU has AMX.

Linux traps the first AMX instruction of a process that has not asked for the tile-data state
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``) and sends it SIGILL
(Documentation/arch/x86/xstate.rst). oneDNN and torch ask before running their own AMX
kernels; vLLM's CPU build runs tile instructions of its own without asking (its bf16
attention, ISA ``amx``, which the toy models' head size 32 takes, and its MoE micro-GEMM), so a
vLLM process on an AMX host survives them only where a oneDNN or torch kernel happened to ask
first. The permission belongs to a process, kept across fork and dropped by exec, so every
process asks: tests/conftest.py calls :func:`request_amx_tiles` in the test process and puts
this folder first on ``PYTHONPATH``, where each child Python (the engine cores and workers
vLLM's CPU platform starts with ``spawn``, reference engines, API servers) finds this file as
its ``sitecustomize``. On a CPU without AMX nothing is asked. A ``sitecustomize`` further on
``sys.path`` (a distribution's) still runs after this one.
"""

from __future__ import annotations

import os
import sys

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_SUPP = 0x1021
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_amx_tiles() -> bool | None:
    """Ask for AMX tile data: True when this process may use it (asked now or before), False
    when the kernel refuses, None where there is nothing to ask for (no AMX tile data on this
    CPU or kernel, or not x86-64 Linux). Never raises."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        supported = ctypes.c_uint64(0)
        if libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_GET_XCOMP_SUPP),
                        ctypes.byref(supported)) != 0:
            return None  # a kernel without dynamic XSTATE features (before Linux 5.16)
        if not supported.value >> XFEATURE_XTILEDATA & 1:
            return None
        return libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                            ctypes.c_long(XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return None


def _next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this one hides, if any (found on ``sys.path`` without this
    folder)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if __name__ == "sitecustomize":
    request_amx_tiles()
    _next_sitecustomize()

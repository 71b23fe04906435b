"""The cores a test's engines bind to (``VLLM_CPU_OMP_THREADS_BIND``).

``make test`` runs the suite in pytest-xdist workers (Makefile: ``TEST_WORKERS``, one module per
worker at a time). vLLM's CPU worker pins its OpenMP threads to the cores it is given and spins
on them, so two engines sharing a core run at a fraction of the speed of two engines on cores
of their own. Each worker therefore gives its engines the next ``tp`` cores in turn, starting
from its own index: on 2 cores worker 0's single-rank engines run on core 0 and worker 1's on
core 1, and a TP=2 engine uses both (as it must)."""

from __future__ import annotations

import os


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def worker_index() -> int:
    """This pytest-xdist worker's index (``gw1`` -> 1); 0 without xdist. Child processes of a
    test inherit the variable, so they agree with it."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def engine_cores(tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for an engine of ``tp`` ranks started by this worker: one
    core per rank, ranks separated by ``|``."""
    cores = _cores()
    start = worker_index() * tp
    return "|".join(str(cores[(start + rank) % len(cores)]) for rank in range(tp))


def other_core() -> str:
    """A core this worker's single-rank engines do not use (the same one on a 1-core host)."""
    cores = _cores()
    return str(cores[(worker_index() + 1) % len(cores)])

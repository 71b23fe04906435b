"""Where a rank's staging threads run (CPU build): outside the forward pass's cores.

vLLM's CPU worker binds itself to its OpenMP cores (``VLLM_CPU_OMP_THREADS_BIND``: an
explicit list per local rank such as ``"0-3|4-7"``, or ``auto``: one NUMA node per rank, less
the cores it reserves for the engine core, ``VLLM_CPU_NUM_OF_RESERVED_CPU``). On Linux a
thread's cpu mask is its own and new threads inherit their creator's, so the poller's threads
(download, sha256, decode, packing ahead) would run on the forward pass's own cores.

:func:`staging_cpus` picks their cores (pure, unit-tested); :func:`plan_staging` reads the
machine (the worker's binding is the calling thread's mask, the allowed set the cgroup's
cpuset); :meth:`Placement.place` moves the calling thread there. The poller calls ``place``
first thing on each thread it owns (its loop, its staging thread, the reader's decode pool);
threads started from a placed thread (asyncio's default executor) inherit its mask.
No vLLM import: the binding is read from the thread and the environment.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from vllm_deltasync.config import parse_cpu_list

logger = logging.getLogger(__name__)

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_NOT_A_LIST = ("", "auto", "nobind", "all")
_SYS = Path("/sys")


def staging_cpus(binding: Iterable[int], allowed: Iterable[int], others: Iterable[int],
                 option: str, *, siblings: Iterable[int] = ()) -> frozenset[int]:
    """The cores the staging threads run on.

    ``binding``: the worker's OpenMP cores; ``allowed``: what the process may use (cgroup);
    ``others``: cores bound by the node's other ranks; ``siblings``: SMT siblings of the
    binding's cores (used only when no other core is free: they share the forward's core).
    ``option`` (``SyncConfig.staging_cpus``): ``inherit`` keeps the binding; a cpu list names
    the cores (those the process may not use dropped; none left: the binding); ``auto``: the
    allowed cores outside the binding and the other ranks', else the binding."""
    bind, ok = frozenset(binding), frozenset(allowed)
    if option == "inherit" or not bind:
        return bind
    if option != "auto":
        return (parse_cpu_list(option) & ok) or bind
    free = ok - bind - frozenset(others)
    return (free - frozenset(siblings)) or free or bind


@dataclass(frozen=True)
class Placement:
    """Where staging runs, and why (for the log line and the rank's status)."""

    cpus: frozenset[int]
    binding: frozenset[int]
    option: str = "auto"

    @property
    def moved(self) -> bool:
        return bool(self.cpus) and self.cpus != self.binding

    def describe(self) -> str:
        if self.moved:
            return (f"staging threads on cpus {format_cpus(self.cpus)} (worker's OpenMP "
                    f"binding: {format_cpus(self.binding)}; staging_cpus={self.option})")
        if self.option == "inherit":
            return (f"staging threads keep the worker's binding {format_cpus(self.binding)} "
                    "(staging_cpus=inherit)")
        return (f"no core outside the worker's binding {format_cpus(self.binding)}: staging "
                "shares it")

    def place(self) -> None:
        """Move the calling thread onto :attr:`cpus` (nothing when it keeps the binding)."""
        if not self.moved:
            return
        try:
            os.sched_setaffinity(0, self.cpus)
        except (AttributeError, OSError) as exc:  # not Linux, or a core the cgroup refuses
            logger.warning("deltasync: cannot move staging thread onto cpus %s (%s); it "
                           "keeps the worker's binding", format_cpus(self.cpus), exc)


def plan_staging(option: str, environ: Mapping[str, str] | None = None) -> Placement:
    """Placement of the staging threads of a rank whose worker binding is the calling thread's
    mask (call it on the worker's main thread, before the poller starts threads)."""
    try:
        binding = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux: no placement
        return Placement(frozenset(), frozenset(), option)
    env = os.environ if environ is None else environ
    allowed = allowed_cpus() | binding
    others = other_ranks_cpus(env.get(BIND_ENV, "auto"), binding, allowed)
    cpus = staging_cpus(binding, allowed, others, option, siblings=smt_siblings(binding))
    return Placement(cpus, binding, option)


def allowed_cpus() -> frozenset[int]:
    """The cores the server may use: the cgroup's effective cpuset (v2, then v1), else every
    cpu of the machine; narrowed to the mask of the process that started the worker (vLLM's
    engine core, which does not bind itself), so that a server started under ``taskset``
    stays on the cores it was given."""
    cpus = frozenset(range(os.cpu_count() or 1))
    for name in ("fs/cgroup/cpuset.cpus.effective", "fs/cgroup/cpuset/cpuset.effective_cpus"):
        text = _read(_SYS / name)
        if text:
            try:
                cpus = parse_cpu_list(text)
                break
            except ValueError:
                continue
    parent = _status_cpus(Path(f"/proc/{os.getppid()}/status"))
    return (cpus & parent) or cpus


def _status_cpus(path: Path) -> frozenset[int]:
    """``Cpus_allowed_list`` of a ``/proc/<pid>/status``; empty when unreadable."""
    for line in _read(path).splitlines():
        if line.startswith("Cpus_allowed_list:"):
            try:
                return parse_cpu_list(line.split(":", 1)[1].strip())
            except ValueError:
                return frozenset()
    return frozenset()


def other_ranks_cpus(bind: str, binding: frozenset[int], allowed: frozenset[int]) -> frozenset[int]:
    """Cores vLLM binds the node's other ranks to. An explicit ``VLLM_CPU_OMP_THREADS_BIND``
    (``"0-3|4-7"``, every local rank, every local DP rank) names them; ``auto`` gives each
    rank its own NUMA node: the nodes not holding this rank's binding; ``nobind``: none."""
    bind = bind.strip()
    if bind == "auto":
        nodes = numa_nodes()
        if len(nodes) < 2:
            return frozenset()
        return frozenset().union(*(cpus for cpus in nodes if not cpus & binding)) & allowed
    if bind in _NOT_A_LIST:
        return frozenset()
    found: set[int] = set()
    for part in bind.split("|"):
        try:
            found |= parse_cpu_list(part)
        except ValueError:
            return frozenset()  # not a list vLLM would accept either: nothing known
    return frozenset(found - binding)


def numa_nodes() -> list[frozenset[int]]:
    nodes = []
    for path in sorted((_SYS / "devices/system/node").glob("node[0-9]*")):
        text = _read(path / "cpulist")
        if text:
            try:
                nodes.append(parse_cpu_list(text))
            except ValueError:
                continue
    return nodes


def smt_siblings(cpus: Iterable[int]) -> frozenset[int]:
    """Logical cpus sharing a physical core with ``cpus`` (themselves excluded)."""
    found: set[int] = set()
    for cpu in cpus:
        text = _read(_SYS / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        if text:
            try:
                found |= parse_cpu_list(text)
            except ValueError:
                continue
    return frozenset(found - set(cpus))


def format_cpus(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


__all__ = ["Placement", "format_cpus", "plan_staging", "staging_cpus"]

"""Following does not steal the forward's cores (CPU build; issue 27, item 5).

vLLM binds a CPU worker to its OpenMP cores and new threads inherit their creator's mask, so
the poller's threads would run on the forward pass's cores. ``server/worker/affinity.py``
moves them onto cores outside the binding where there are any. The pure choice is tested
here, then the real poller's threads (its loop, its staging thread, the reader's decode pool)
started from a thread bound to one core, as the worker's main thread is. Linux only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.waiting import wait_until
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.server.worker import affinity
from vllm_deltasync.server.worker.affinity import (
    BIND_ENV,
    format_cpus,
    other_ranks_cpus,
    staging_cpus,
)
from vllm_deltasync.server.worker.poller import Poller
from vllm_deltasync.stores import open_store

linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux thread affinity")


# -- the choice ---------------------------------------------------------------------------------

def test_auto_takes_the_allowed_cores_outside_the_binding() -> None:
    assert staging_cpus({0}, {0, 1}, set(), "auto") == {1}
    assert staging_cpus({0, 1}, range(8), set(), "auto") == set(range(2, 8))


def test_auto_leaves_the_other_ranks_cores_alone() -> None:
    # TP=2, VLLM_CPU_OMP_THREADS_BIND="0-2|3-5" on 8 cores: rank 0 stages on 6-7
    assert staging_cpus({0, 1, 2}, range(8), {3, 4, 5}, "auto") == {6, 7}


def test_auto_keeps_the_binding_where_no_core_is_free() -> None:
    assert staging_cpus({0, 1}, {0, 1}, set(), "auto") == {0, 1}
    assert staging_cpus({0}, {0, 1}, {1}, "auto") == {0}  # the only other core is rank 1's


def test_auto_prefers_cores_that_are_not_smt_siblings_of_the_binding() -> None:
    assert staging_cpus({0}, range(4), set(), "auto", siblings={2}) == {1, 3}
    assert staging_cpus({0}, {0, 2}, set(), "auto", siblings={2}) == {2}  # better than sharing


def test_inherit_and_explicit_lists() -> None:
    assert staging_cpus({0}, {0, 1}, set(), "inherit") == {0}
    assert staging_cpus({0}, range(8), set(), "2-3,5") == {2, 3, 5}
    assert staging_cpus({0}, range(4), set(), "2-5") == {2, 3}  # outside the cgroup: dropped
    assert staging_cpus({0}, range(4), set(), "6,7") == {0}  # none allowed: the binding
    assert staging_cpus(set(), range(4), set(), "auto") == set()  # affinity unknown


def test_other_ranks_from_vllms_binding_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    every = frozenset(range(16))
    assert other_ranks_cpus("0-3|4-7", frozenset(range(4)), every) == set(range(4, 8))
    assert other_ranks_cpus("0-3|4-7|8,9|10", frozenset({8, 9}), every) == set(range(8)) | {10}
    assert other_ranks_cpus("nobind", frozenset({0}), every) == set()
    assert other_ranks_cpus("0-x|4", frozenset({0}), every) == set()  # not a list: unknown
    # auto: one NUMA node per rank, the nodes without this rank's cores are the others'
    nodes = [frozenset(range(8)), frozenset(range(8, 16))]
    monkeypatch.setattr(affinity, "numa_nodes", lambda: nodes)
    assert other_ranks_cpus("auto", frozenset(range(7)), every) == set(range(8, 16))
    monkeypatch.setattr(affinity, "numa_nodes", lambda: nodes[:1])
    assert other_ranks_cpus("auto", frozenset(range(7)), every) == set()


def test_format_cpus() -> None:
    assert format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert format_cpus({3}) == "3"
    assert format_cpus(()) == "none"


@pytest.mark.parametrize("bad", ["x", "3-1", "1,,a", ",", "-2"])
def test_a_bad_cpu_list_is_refused_naming_the_option(bad: str) -> None:
    with pytest.raises(ConfigError, match="staging_cpus.*'auto', 'inherit' or a cpu list"):
        SyncConfig(url="file:///b", staging_cpus=bad)


def test_the_option_parses_from_env() -> None:
    env = {"VLLM_DELTASYNC_URL": "file:///b", "VLLM_DELTASYNC_STAGING_CPUS": "2-3"}
    assert SyncConfig.from_sources(None, env).staging_cpus == "2-3"
    assert SyncConfig(url="file:///b").staging_cpus == "auto"


@linux
def test_the_allowed_cores_are_the_cgroups_within_the_parent_process_mask() -> None:
    allowed = affinity.allowed_cpus()
    assert allowed and allowed <= set(range(os.cpu_count() or 1))
    assert allowed <= affinity._status_cpus(Path(f"/proc/{os.getppid()}/status"))
    assert affinity._status_cpus(Path("/nonexistent/status")) == set()


# -- the poller's threads -----------------------------------------------------------------------

def _publish(root: Path) -> str:
    """Two steps of 12 tensors: each file holds several chunks (the decode pool runs)."""
    gen = torch.Generator().manual_seed(0)
    base = {f"layer.{i}.weight": torch.randn(64, 96, generator=gen).to(torch.bfloat16)
            for i in range(12)}
    after = {n: t.clone() for n, t in base.items()}
    for t in after.values():
        t.view(torch.int16).reshape(-1)[::37] += 1
    url = f"file://{root}/bucket"
    with DeltaPublisher(url) as pub:
        pub.publish(0, base)
        pub.publish(1, after)
        pub.flush()
    return url


def _on(cpus: set[int], fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a new thread bound to ``cpus`` (as vLLM binds the worker's main thread)."""
    out: dict[str, Any] = {}

    def main() -> None:
        try:
            os.sched_setaffinity(0, cpus)
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            out["error"] = exc

    thread = threading.Thread(target=main)
    thread.start()
    thread.join(60)
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture
def following(tmp_path: Path) -> Iterator[Callable[..., Poller]]:
    """Starts a poller from a thread bound to ``binding`` and waits for its first staged step;
    closes it after the test."""
    url = _publish(tmp_path)
    made: list[Poller] = []
    _EARLIER.clear()
    _EARLIER.update(threading.enumerate())  # a closed poller's pool may still be winding down

    def start(binding: set[int], **options: Any) -> Poller:
        def build() -> Poller:
            cfg = SyncConfig(url=url, poll_interval_s=0.05, **options)
            reader = BucketReader(open_store(url), decode_threads=2)  # decode pool runs
            poller = Poller(cfg, lambda m, p: (p, 0), reader=reader)
            made.append(poller)
            poller.start()
            return poller

        poller = _on(binding, build)
        wait_until(poller.ready_steps, 30, "a staged step", status=poller.status)
        return poller

    yield start
    for poller in made:
        poller.close()


_EARLIER: set[threading.Thread] = set()


def _staging_threads() -> dict[str, set[int]]:
    """The affinity of each live thread of the rank's poller (loop, stager, decode pool)."""
    found = {}
    for t in threading.enumerate():
        if t not in _EARLIER and t.name.startswith(("deltasync-poller-rank0", "deltasync-stage-rank0",
                              "deltasync-decode")) and t.native_id is not None:
            found[t.name] = os.sched_getaffinity(t.native_id)
    return found


def _two_cores() -> tuple[int, int]:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip(f"needs 2 cores allowed, this process has {mine}")
    return mine[0], mine[1]


@linux
def test_staging_threads_leave_the_workers_binding(
        following: Callable[..., Poller], monkeypatch: pytest.MonkeyPatch) -> None:
    forward, free = _two_cores()
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: frozenset({forward, free}))
    monkeypatch.setenv(BIND_ENV, str(forward))  # vLLM's variable: TP=1 bound to `forward`
    poller = following({forward})
    threads = _staging_threads()
    names = sorted(threads)
    assert any(n.startswith("deltasync-poller-rank0") for n in names), names
    assert any(n.startswith("deltasync-stage-rank0") for n in names), names
    assert any(n.startswith("deltasync-decode") for n in names), names
    assert threads == {n: {free} for n in names}
    assert poller.placement.binding == {forward}
    assert poller.status().staging_cpus == str(free)


@linux
def test_staging_keeps_the_binding_when_it_covers_every_allowed_core(
        following: Callable[..., Poller], monkeypatch: pytest.MonkeyPatch) -> None:
    both = set(_two_cores())
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: frozenset(both))
    monkeypatch.setenv(BIND_ENV, "auto")
    poller = following(both)
    threads = _staging_threads()
    assert threads and threads == {n: both for n in threads}
    assert not poller.placement.moved


@linux
def test_staging_cpus_inherit_keeps_the_binding(
        following: Callable[..., Poller], monkeypatch: pytest.MonkeyPatch) -> None:
    forward, free = _two_cores()
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: frozenset({forward, free}))
    following({forward}, staging_cpus="inherit")
    threads = _staging_threads()
    assert threads and threads == {n: {forward} for n in threads}


@linux
def test_the_start_line_says_where_staging_runs(
        following: Callable[..., Poller], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    forward, free = _two_cores()
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: frozenset({forward, free}))
    monkeypatch.setenv(BIND_ENV, str(forward))
    with caplog.at_level("INFO", logger="vllm_deltasync.server.worker.poller"):
        following({forward})
    assert (f"staging threads on cpus {free} (worker's OpenMP binding: {forward}"
            in caplog.text), caplog.text

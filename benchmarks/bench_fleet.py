"""Fleet benchmark: N replicas following one bucket, with and without a mirror and jitter.

A real ``DeltaPublisher`` publishes a small model's steps to the local Hub bucket server
(``tests/helpers/hubserver.py``, in its own process, no quotas: it counts what it is asked) at one
step per simulated minute. N simulated replicas follow it, in a few worker processes, each on
its own ``StepWatcher`` (the events feed, with the poller's intervals: ``poller.watcher_options``,
``branch_check_s``), its own node cache (``NodeCachedStore``) and ``BucketReader`` (download,
verify, decode; no engine, no apply), with the poller's request pattern: the newest manifest read
fresh when it changes, the applied one read again every ``branch_check_s`` unless a newer step
continues it, the chain planned, then each step downloaded after its jitter. With the mirror,
data objects come through nginx configured from ``deploy/nginx/`` (``tests/helpers/mirrorserver.py``).

Time is compressed k-fold: every interval (poll, listing, feed checks, branch checks, jitter, the
publishing cadence, the feed's connection lifetime) is divided by k, so one simulated minute
lasts 60/k s; durations are reported in simulated seconds (measured x k), which makes them an
upper bound where this 2-core machine is the bottleneck (1,000 replicas share two cores with
the Hub server and nginx). Counts are taken over 5 simulated minutes after every replica holds
the anchor (start-up not counted; 3 for the 1,000-replica rows, scaled to 5).

* origin requests: what counts against a Hub token (API calls + resolves), per 5 minutes;
  CDN requests (signed URLs, not counted by the Hub's quota) are shown apart;
* origin bytes per step: what the origin's CDN served per step (data and manifests);
* mirror hit ratio: the mirror's answers served from its cache;
* commit -> held: from the trainer's commit of a step to a replica holding it (downloaded,
  verified, decoded), over every replica and step: p50, p99, and the slowest.

    .venv/bin/python -m benchmarks.bench_fleet [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import multiprocessing as mp
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUCKET, PREFIX = "bench/fleet", "run"
URL = f"hf://buckets/{BUCKET}/{PREFIX}"
STEP_S = 60.0
"""Simulated seconds between two published steps (one step per minute)."""
POLL_S = 10.0
"""The fleet's ``poll_interval_s`` (simulated seconds)."""
STEPS = 5
"""Steps published in the measured window (5 simulated minutes)."""
SHAPES = {"embed.weight": (1024, 64), "head.weight": (1024, 64),
          **{f"layers.{i}.{n}.weight": s for i in range(4)
             for n, s in (("q", (64, 64)), ("k", (64, 64)), ("v", (64, 64)), ("o", (64, 64)),
                          ("up", (256, 64)), ("down", (64, 256)))}}
GOAL = 20_000
"""Origin requests per 5 minutes 1,000 single-node replicas with a mirror must stay under."""


@dataclass(frozen=True)
class Row:
    replicas: int
    mirror: bool
    jitter: bool
    k: float
    """Time compression."""
    steps: int = STEPS
    """Steps published in the measured window (simulated minutes; counts are scaled to 5)."""


FULL = (Row(10, False, False, 20), Row(10, True, True, 20),
        Row(100, False, False, 20), Row(100, True, False, 20), Row(100, False, True, 20),
        Row(100, True, True, 20),
        Row(1000, False, False, 3, steps=3), Row(1000, True, True, 3, steps=3))
"""The 1,000-replica rows count over 3 simulated minutes (scaled to 5): the pattern repeats
every minute (one step, a branch check every ``min(60, 10 x poll)`` s), and at k=3 each minute
lasts 20 s of this machine's time."""
QUICK = (Row(10, False, False, 30), Row(10, True, True, 30), Row(50, True, True, 30))


# ---------------------------------------------------------------- one replica (worker side)
def _worker(spec: dict[str, Any], indices: list[int], out: Any, stop: Any) -> None:
    asyncio.run(_replicas(spec, indices, out, stop))


async def _replicas(spec: dict[str, Any], indices: list[int], out: Any, stop: Any) -> None:
    import aiohttp

    from vllm_deltasync.format.codecs import prepare_decoders

    prepare_decoders()  # as a rank does before it follows: no JIT compile inside a step

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=30)
    sessions = (aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)),
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                      cookie_jar=aiohttp.DummyCookieJar()))
    held: list[tuple[int, int, float]] = []
    errors: list[str] = []
    tasks = [asyncio.create_task(_replica(i, spec, sessions, held, errors)) for i in indices]
    try:
        while not stop.is_set():
            await asyncio.sleep(0.1)
            if held or errors:
                out.put((list(held), list(errors)))
                held.clear()
                errors.clear()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for session in sessions:
            await session.close()
        out.put((held, errors))


async def _replica(i: int, spec: dict[str, Any], sessions: tuple[Any, Any],
                   held: list[tuple[int, int, float]], errors: list[str]) -> None:
    from vllm_deltasync.config import SyncConfig
    from vllm_deltasync.format.manifest import Manifest
    from vllm_deltasync.format.reader import BucketReader
    from vllm_deltasync.server.worker.bucket import branch_check_s, fetch_jitter_s, watcher_options
    from vllm_deltasync.server.worker.discovery import StepWatcher
    from vllm_deltasync.stores import RetryPolicy
    from vllm_deltasync.stores.base import Store
    from vllm_deltasync.stores.hf import HfOptions, HfStore
    from vllm_deltasync.stores.mirrors import MirroredStore
    from vllm_deltasync.stores.nodecache import NodeCachedStore, cache_root

    k = spec["k"]
    retries = RetryPolicy(attempts=8, base_delay_s=0.05, max_delay_s=2.0)
    store: Store = HfStore(BUCKET, PREFIX, HfOptions(endpoint=spec["endpoint"], token=spec["token"],
                                                     retry_policy=retries),
                           session=sessions[0], environ={})
    if spec["mirror"]:
        store = MirroredStore(store, [spec["mirror"]], session=sessions[1])
    store = NodeCachedStore(store, cache_root(Path(spec["cache"]) / f"r{i}", URL, "node"),
                            ttl_s=3600.0)
    reader = BucketReader(store, decode_threads=1, max_concurrency=4)
    cfg = SyncConfig(url=URL, poll_interval_s=POLL_S)
    intervals = {name: value / k for name, value in watcher_options(cfg).items()}
    watcher = StepWatcher(store, **intervals, events_retry_s=600 / k,  # type: ignore[arg-type]
                          events_min_connect_interval_s=30 / k, events_idle_s=120 / k,
                          events_check_s=max(3 * POLL_S, 30.0) / k, retry_policy=retries)
    branch_s, poll_s = branch_check_s(cfg) / k, POLL_S / k
    jitter_s = fetch_jitter_s(cfg, "hf") / k if spec["jitter"] else 0.0
    applied: Manifest | None = None
    newest_seen: int | None = None
    spread_for: int | None = None
    next_branch = time.monotonic() + branch_s
    await asyncio.sleep(random.uniform(0, poll_s))  # replicas start at random phases
    try:
        while True:
            try:
                target = await watcher.wait_for_new(None if applied is None else applied.step,
                                                    timeout_s=poll_s)
                latest = watcher.latest
                if latest is not None and latest != newest_seen:  # the poller's fresh read
                    await reader.manifest(latest, fresh=True)
                    newest_seen = latest
                if applied is not None and time.monotonic() >= next_branch:  # branch check
                    await reader.manifest(applied.step, fresh=True)
                    next_branch = time.monotonic() + branch_s
                if target is None:
                    continue
                plan = await reader.plan(applied, target)
                if plan and applied is not None and plan[0].kind == "delta":
                    next_branch = time.monotonic() + branch_s  # the newest step continues ours
                if jitter_s and target != spread_for:
                    spread_for = target
                    await asyncio.sleep(random.uniform(0.0, jitter_s))
                for m in plan:
                    async for _ in reader.iter_patches(m):
                        pass
                    applied = m
                    held.append((i, m.step, time.monotonic()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the poller reports and goes on
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(poll_s)
    finally:
        await watcher.close()
        await reader.close()


# ---------------------------------------------------------------- one row (coordinator)
def _weights() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {n: (torch.randn(s, generator=g) * 0.02).bfloat16() for n, s in SHAPES.items()}


def _train(weights: dict[str, Any], g: Any) -> None:
    import torch

    for t in weights.values():  # ~1% of the bf16 elements change per step
        bits = t.view(torch.int16).reshape(-1)
        bits[torch.rand(bits.numel(), generator=g) < 0.01] += 1


def _uploader(info: dict[str, str]) -> Any:
    import aiohttp

    async def upload(items: list[tuple[str, bytes]]) -> None:
        async with aiohttp.ClientSession() as session:
            for path, data in items:
                url = f"{info['endpoint']}/_test/upload/{BUCKET}/{path}"
                async with session.put(url, data=data,
                                       headers={"Authorization": f"Bearer {info['token']}"}) as r:
                    r.raise_for_status()

    return upload


class _Held:
    """What the workers report: when each replica held each step."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.at: dict[tuple[int, int], float] = {}
        self.errors: list[str] = []

    def drain(self, timeout_s: float = 0.1) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                rows, errors = self.out.get(timeout=timeout_s)
                for i, step, t in rows:
                    self.at.setdefault((i, step), t)
                self.errors += errors
                timeout_s = 0.0

    def holding(self, step: int) -> int:
        return sum(1 for (_, s) in self.at if s == step)

    def wait_all(self, step: int, n: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.drain()
            if self.holding(step) >= n:
                return True
        return False


def _row(row: Row, cache: Path) -> dict[str, Any]:
    from vllm_deltasync import DeltaPublisher

    mirrors = importlib.import_module("tests.helpers.mirrorserver")
    command = [sys.executable, "-m", "tests.helpers.hubserver", "--bucket", BUCKET, "--no-quota",
               "--events-max-s", str(600 / row.k)]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          cwd=ROOT) as hub:
        assert hub.stdout is not None and hub.stdin is not None
        info = json.loads(hub.stdout.readline())
        mirror = None
        if row.mirror:
            mirror = mirrors.NginxMirror(f"{info['endpoint']}/buckets/{BUCKET}/resolve/{PREFIX}/",
                                         f"Bearer {info['token']}")
            mirror.start()
        try:
            return _measure(row, info, mirror, cache, DeltaPublisher)
        finally:
            if mirror is not None:
                mirror.stop()
            hub.stdin.close()


def _measure(row: Row, info: dict[str, str], mirror: Any, cache: Path, publisher_cls: Any) -> dict[str, Any]:
    import torch

    commits: dict[int, float] = {}
    options = {"endpoint": info["endpoint"], "token": info["token"], "environ": {},
               "uploader": _uploader(info)}
    weights, g = _weights(), torch.Generator().manual_seed(1)
    spec = {"endpoint": info["endpoint"], "token": info["token"], "k": row.k,
            "mirror": mirror.url if mirror else None, "jitter": row.jitter,
            "cache": str(cache / f"{row.replicas}-{row.mirror}-{row.jitter}")}
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    workers = 1 if row.replicas <= 10 else 2
    with publisher_cls(URL, anchor_every=1000, max_file_bytes=256 << 10, store_options=options,
                       on_commit=lambda m: commits.setdefault(m.step, time.monotonic())) as pub:
        pub.publish(0, weights)
        pub.flush()
        procs = [ctx.Process(target=_worker, args=(spec, list(range(w, row.replicas, workers)),
                                                   out, stop), daemon=True) for w in range(workers)]
        for p in procs:
            p.start()
        held = _Held(out)
        started = held.wait_all(0, row.replicas, timeout_s=300)
        answered0 = len(mirror.answers()) if mirror else 0
        first = time.monotonic()
        for step in range(1, row.steps + 1):  # one step per simulated minute
            time.sleep(max(0.0, first + (step - 1) * STEP_S / row.k - time.monotonic()))
            _train(weights, g)
            pub.publish(step, weights)
        pub.flush()
        done = held.wait_all(row.steps, row.replicas, timeout_s=max(60.0, 3 * STEP_S / row.k))
        stop.set()
        held.drain(1.0)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        held.drain(0.5)
    window = (commits[1], commits[1] + row.steps * STEP_S / row.k)
    with urllib.request.urlopen(f"{info['endpoint']}/_test/log?since={window[0]}") as resp:
        log = [r for r in json.loads(resp.read()) if r[0] < window[1]]
    answers = mirror.answers()[answered0:] if mirror else []
    latencies = sorted((t - commits[s]) * row.k for (_, s), t in held.at.items() if 1 <= s <= row.steps)
    expected = row.replicas * row.steps
    return {
        "row": row, "started": started, "done": done,
        "api": sum(1 for r in log if r[1] == "api"),
        "resolve": sum(1 for r in log if r[1] == "resolve"),
        "cdn": sum(1 for r in log if r[1] == "cdn"),
        "data_bytes": sum(r[4] for r in log if r[1] == "cdn" and "/data/" in r[3]),
        "manifest_bytes": sum(r[4] for r in log if r[1] == "cdn" and "/manifests/" in r[3]),
        "hits": sum(1 for _, _, s in answers if s == "HIT"), "answers": len(answers),
        "latencies": latencies, "missing": expected - len(latencies), "expected": expected,
        "errors": held.errors,
    }


# ---------------------------------------------------------------- the table
def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _line(r: dict[str, Any]) -> str:
    row: Row = r["row"]
    per5 = 5.0 / row.steps  # the window is row.steps simulated minutes
    origin = (r["api"] + r["resolve"]) * per5
    lat = r["latencies"]
    hit = f"{r['hits'] / r['answers']:.3f}" if r["answers"] else "-"
    held = f"{r['expected'] - r['missing']}/{r['expected']}"
    return (f"| {row.replicas} | {'yes' if row.mirror else 'no'} | {'yes' if row.jitter else 'no'} "
            f"| {row.k:g} | {origin:,.0f} | {origin / row.replicas:.1f} | {r['api'] * per5:,.0f} "
            f"| {r['cdn'] * per5:,.0f} | {r['data_bytes'] / row.steps / 1e6:.2f} "
            f"| {r['manifest_bytes'] / row.steps / 1e6:.2f} | {hit} "
            f"| {statistics.median(lat) if lat else float('nan'):.1f} | {_quantile(lat, 0.99):.1f} "
            f"| {max(lat) if lat else float('nan'):.1f} | {held} |")


def run(quick: bool = False) -> str:
    """Markdown section: one row per (replicas, mirror, jitter), then the goal line."""
    mirrors = importlib.import_module("tests.helpers.mirrorserver")
    rows = QUICK if quick else FULL
    if mirrors.nginx_binary() is None:
        rows = tuple(r for r in rows if not r.mirror)
    results = []
    shm = Path("/dev/shm")  # the node caches live in RAM, as a server's do by default
    with tempfile.TemporaryDirectory(prefix="deltasync-fleet-",
                                     dir=shm if shm.is_dir() else None) as tmp:
        for row in rows:
            print(f"[fleet] {row}", file=sys.stderr, flush=True)
            results.append(_row(row, Path(tmp)))
    lines = [
        f"A small model ({sum(a * b for a, b in SHAPES.values()) / 1e3:.0f}k bf16 parameters, "
        "~1% changed per step, one data file per delta, each replica its own node) published at "
        "one step per simulated "
        f"minute; replicas on the events feed with poll_interval_s = {POLL_S:g} s (simulated), "
        "fetch_jitter_s unset (min(poll, 5) s) where jitter is on; counts over 5 simulated "
        "minutes after every replica holds the anchor (3 for 1,000 replicas, scaled to 5: the "
        "pattern repeats every simulated minute). Origin requests = API calls + resolves "
        "(what a Hub token's quota counts); CDN requests and bytes apart. Durations in "
        "simulated seconds (measured x k: an upper bound where the two cores are the limit).",
        "",
        "| replicas | mirror | jitter | time x | origin requests / 5 min | per replica | of which "
        "API | CDN requests / 5 min | origin data MB / step | origin manifest MB / step | mirror "
        "hit ratio | commit -> held p50 s | p99 s | slowest s | (replica, step) held |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(_line(r) for r in results),
    ]
    goal = [r for r in results if r["row"].replicas == 1000 and r["row"].mirror]
    if goal:
        origin = (goal[0]["api"] + goal[0]["resolve"]) * 5.0 / goal[0]["row"].steps
        verdict = "meets" if origin < GOAL and not goal[0]["missing"] else "MISSES"
        lines += ["", f"1,000 replicas with the mirror: {origin:,.0f} origin requests per 5 "
                  f"minutes at one step per minute: {verdict} the goal (< {GOAL:,})."]
    errors = sorted({e for r in results for e in r["errors"]})
    if errors:
        lines += ["", f"Replica errors (retried, as the poller does): {len(errors)} kinds, e.g. "
                  f"`{errors[0]}`"]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print(run(quick=parser.parse_args().quick))

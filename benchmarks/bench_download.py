"""Download benchmark: hf:// throughput vs a plain parallel GET, and the request budget.

1. **Throughput.** The local Hub bucket server (``tests/helpers/hubserver.py``, run in its own
   process so it does not share the client's GIL) serves a multi-file step with a
   per-connection bandwidth limit on its CDN origin, mimicking a CDN / object store (~50-100
   MB/s per connection in production, scaled down here). The same bytes are fetched (a) through
   the project (``HfStore.read`` of every file, 8 files at a time as ``BucketReader`` does,
   default part size) and (b) by a plain aiohttp client issuing one GET per file, all in
   parallel, following the redirect. Median of the repeats; the ratio is (a)/(b), target >= 0.9.
   A third row shows smaller parts (more parallel ranges per file).
2. **Request budget.** A ``StepWatcher`` at default settings follows a bucket where a step is
   published every minute, with time compressed k-fold (every interval divided by k, the run
   lasts 1 h / k); the server counts API and resolve calls. Reported per replica per hour and
   for 32 replicas sharing one token per 5-minute window, against the free tier (1000 API
   calls, 5000 resolves). Downloads add one resolve per file read (manifest + data files).

    .venv/bin/python benchmarks/bench_download.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from vllm_deltasync.format.layout import manifest_path
from vllm_deltasync.server.worker.discovery import StepWatcher
from vllm_deltasync.stores.hf import HfOptions, HfStore

ROOT = Path(__file__).resolve().parents[1]
"""The repository: the local Hub bucket server is ``tests.helpers.hubserver`` there."""
BUCKET = "bench/step"
REPLICAS = 32
FILES_PER_STEP = 4  # data files a replica reads per step in the budget estimate (+1 manifest)


def _load_hubserver() -> Any:
    return importlib.import_module("tests.helpers.hubserver")


# -- throughput ------------------------------------------------------------------------------


async def _upload(info: dict[str, str], files: dict[str, bytes]) -> None:
    headers = {"Authorization": f"Bearer {info['token']}"}
    async with aiohttp.ClientSession() as session:
        for path, data in files.items():
            url = f"{info['endpoint']}/_test/upload/{BUCKET}/{path}"
            async with session.put(url, data=data, headers=headers) as resp:
                resp.raise_for_status()


async def _project(info: dict[str, str], paths: list[str], **options: Any) -> int:
    settings = HfOptions(endpoint=info["endpoint"], token=info["token"], **options)
    store = HfStore(BUCKET, options=settings, environ={})
    limiter = asyncio.Semaphore(8)

    async def one(path: str) -> int:
        async with limiter:
            return len(await store.read(path))

    try:
        return sum(await asyncio.gather(*(one(p) for p in paths)))
    finally:
        await store.close()


async def _plain(info: dict[str, str], paths: list[str]) -> int:
    headers = {
        "Authorization": f"Bearer {info['token']}"
    }  # aiohttp drops it on the cross-origin hop
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(path: str) -> int:
            url = f"{info['endpoint']}/buckets/{BUCKET}/resolve/{path}"
            async with session.get(url, headers=headers) as resp:
                resp.raise_for_status()
                return len(await resp.read())

        return sum(await asyncio.gather(*(one(p) for p in paths)))


async def _time(call: Any) -> float:
    started = time.perf_counter()
    total = await call
    return total / (time.perf_counter() - started) / 1e6


async def _throughput_rows(
    info: dict[str, str], paths: list[str], repeats: int, small_part: int
) -> dict[str, float]:
    runs: dict[str, list[float]] = {"plain": [], "project": [], "small": []}
    for _ in range(repeats):  # interleaved, so drift hits every client alike
        runs["plain"].append(await _time(_plain(info, paths)))
        runs["project"].append(await _time(_project(info, paths)))
        runs["small"].append(await _time(_project(info, paths, part_size=small_part)))
    return {name: statistics.median(values) for name, values in runs.items()}


def _throughput(quick: bool) -> tuple[str, float]:
    n_files, size, rate = (4, 4 << 20, 8e6) if quick else (8, 16 << 20, 10e6)
    repeats = 2 if quick else 3
    files = {
        f"data/000000000001-bench/{i:05d}.safetensors": os.urandom(size) for i in range(n_files)
    }
    command = [sys.executable, "-m", "tests.helpers.hubserver", "--bucket", BUCKET,
               "--cdn-bytes-per-s", str(rate)]
    with subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    ) as server:
        assert server.stdout is not None and server.stdin is not None
        info = json.loads(server.stdout.readline())

        async def measure() -> dict[str, float]:
            await _upload(info, files)
            return await _throughput_rows(
                info, list(files), repeats, small_part=max(1 << 20, size // 4)
            )

        rows = asyncio.run(measure())
        server.stdin.close()
    ratio = rows["project"] / rows["plain"]
    table = [
        f"Step: {n_files} files x {size >> 20} MiB; CDN limited to {rate / 1e6:.0f} MB/s per connection; "
        f"median of {repeats}.",
        "",
        "| client | MB/s | vs plain GET |",
        "|---|---:|---:|",
        f"| plain parallel GET (aiohttp, one per file) | {rows['plain']:.1f} | 1.00 |",
        f"| project: HfStore.read, default settings | {rows['project']:.1f} | {ratio:.2f} |",
        f"| project: parts of {max(1, size // 4) >> 20} MiB (4 ranges per file) | {rows['small']:.1f} | "
        f"{rows['small'] / rows['plain']:.2f} |",
    ]
    return "\n".join(table), ratio


# -- request budget --------------------------------------------------------------------------


async def _follow(hub: Any, k: float, duration_s: float, events: bool) -> int:
    hub.create_bucket(BUCKET)
    store = HfStore(BUCKET, options=HfOptions(endpoint=hub.endpoint, token=hub.token), environ={})
    watcher = StepWatcher(
        store,
        probe_interval_s=10.0 / k,
        listing_interval_s=600.0 / k,
        empty_listing_interval_s=30.0 / k,
        events_retry_s=600.0 / k,
        events_min_connect_interval_s=30.0 / k,
        use_events=events,
    )
    step, seen, started = 0, 0, time.monotonic()

    async def trainer() -> None:
        nonlocal step
        while time.monotonic() - started < duration_s:
            step += 1
            await asyncio.to_thread(hub.put, BUCKET, manifest_path(step), b"{}")
            await asyncio.sleep(60.0 / k)

    task = asyncio.create_task(trainer())
    last = None
    while (left := duration_s - (time.monotonic() - started)) > 0:
        got = await watcher.wait_for_new(last, timeout_s=left)
        if got is not None:
            last, seen = got, seen + 1
    await task
    await watcher.close()
    await store.close()
    return seen


def _budget_row(k: float, events: bool) -> dict[str, float]:
    hubserver = _load_hubserver()
    duration_s = 3600.0 / k
    with hubserver.HubServer() as hub:
        hub.faults.events_enabled = events
        hub.faults.events_max_s = 600.0 / k  # assumption: the Hub ends a feed every ~10 min
        hub.set_quota("api", 1000, 300.0 / k)  # the 5-minute windows are compressed too
        hub.set_quota("resolve", 5000, 300.0 / k)
        seen = asyncio.run(_follow(hub, k, duration_s, events))
        api = len(hub.requests("api"))
        resolve = len(hub.requests("resolve"))
    return {"api": api, "resolve": resolve, "seen": seen, "published": 60}


def _budget(quick: bool) -> str:
    k = 360.0 if quick else 240.0
    lines = [
        f"Default StepWatcher settings, one step per minute, time compressed {k:.0f}x "
        f"(a {3600 / k:.0f} s run = 1 h; the counts per simulated hour do not depend on k while "
        "the watcher keeps up, which steps seen / published shows). "
        f"Downloads: {1 + FILES_PER_STEP} resolves per step "
        f"(manifest + {FILES_PER_STEP} files). Free tier per 5 min: 1000 API calls, 5000 resolves.",
        "",
        "| discovery | steps seen / published | API calls / replica / h | resolves / replica / h "
        f"(discovery) | {REPLICAS} replicas per 5 min: API | {REPLICAS} replicas per 5 min: resolves "
        "(incl. downloads) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for events in (True, False):
        row = _budget_row(k, events)
        per5 = REPLICAS / 12
        downloads = 60 * (1 + FILES_PER_STEP)
        lines.append(
            f"| {'events feed' if events else 'polling (no feed)'} | {row['seen']:.0f} / ~{row['published']} | "
            f"{row['api']:.0f} | {row['resolve']:.0f} | {row['api'] * per5:.0f} ({row['api'] * per5 / 10:.1f}%) | "
            f"{(row['resolve'] + downloads) * per5:.0f} ({(row['resolve'] + downloads) * per5 / 50:.1f}%) |"
        )
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    """Markdown section: throughput table, then the request budget table."""
    table, ratio = _throughput(quick)
    verdict = "meets" if ratio >= 0.9 else "MISSES"
    return "\n".join(
        [
            "## Download (hf:// against the local Hub bucket server)",
            "",
            table,
            "",
            f"Project / plain GET = {ratio:.2f}: {verdict} the 0.9 target.",
            "",
            "### Request budget at default settings",
            "",
            _budget(quick),
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print(run(quick=parser.parse_args().quick))

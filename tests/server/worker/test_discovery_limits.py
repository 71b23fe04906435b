"""Issue 36 row S8: a garbage manifest under the *next* step's name must not make discovery spin.

Before the fix, the probe found the garbage name, took the hit as "found", and the round ran
again at once: file:// 74,540 probes and 5.5 CPU s per 10 s, hf:// 5,000 resolve requests in
10 s (a quota used up), ``/synced`` 200 meanwhile and ``close()`` raising ``TimeoutError``. Now a
set-aside manifest is remembered, every discovery round lasts at least the poll interval, the
rank's status carries the error (``last_error``) and ``close()`` returns within its bound.

Each case runs the real poller (``Follower``: the rank's ``Poller`` and ``SyncState``) against a
bucket the real ``DeltaPublisher`` wrote, with one garbage manifest planted under the next
name; requests are counted where they land (the ``file://`` store's counters, the local Hub
server's log) over a few seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.helpers.follow import Follower, Weights, publish_steps, seeded_weights
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.format.layout import manifest_path

POLL_S = 0.2
WATCH_S = 3.0
ROUNDS = WATCH_S / POLL_S
GARBAGE = b"\x00garbage, not a manifest"


def _three_steps(url: str, options: dict[str, Any] | None = None) -> dict[int, Weights]:
    truth: dict[int, Weights] = {}
    w, g = seeded_weights(3), torch.Generator().manual_seed(4)
    with DeltaPublisher(url, anchor_every=10, store_options=options) as pub:
        publish_steps(pub, w, g, range(3), truth)
    return truth


def _settled(f: Follower, truth: dict[int, Weights]) -> None:
    """Follow to step 2 with the garbage step 3 reported: the state the counts are taken in."""
    f.follow_until(lambda: f.at(2, truth[2]) and f.poller.status().last_error is not None)
    error = f.poller.status().last_error
    assert manifest_path(3) in error and "skipped" in error and "\n" not in error


def _closes_in_time(f: Follower) -> None:
    began = time.monotonic()
    f.poller.close()  # never raises, and returns well within its 10 s bound
    assert time.monotonic() - began < 3.0


def test_S8_garbage_next_manifest_on_file_costs_one_probe_per_poll(
        tmp_path: Path, follower_factory: Callable[..., Follower]) -> None:
    url, root = f"file://{tmp_path}/bucket", tmp_path / "bucket"
    truth = _three_steps(url)
    (root / manifest_path(3)).write_bytes(GARBAGE)
    f = follower_factory(url, {k: torch.zeros_like(v) for k, v in truth[0].items()},
                         poll_interval_s=POLL_S)
    _settled(f, truth)
    stats = f.poller._reader.store.stats
    before, cpu = sum(stats.requests.values()), time.process_time()
    time.sleep(WATCH_S)
    requests = sum(stats.requests.values()) - before
    # one probe of the next name (past the set-aside one) per poll, a listing now and then
    assert requests <= 2 * ROUNDS + 4, stats.requests
    assert time.process_time() - cpu < 1.0  # was 5.5 CPU s per 10 s of spinning
    status = f.poller.status()
    assert status.applied_step == 2 and status.newest_step == 2
    assert manifest_path(3) in status.last_error  # /synced's rank row names it
    _closes_in_time(f)


def test_S8_garbage_next_manifest_on_hf_costs_one_resolve_per_poll(
        hub: Any, make_hf_store: Callable[..., Any],
        follower_factory: Callable[..., Follower]) -> None:
    hub.faults.events_enabled = False  # the feed is best effort: discovery probes
    store = make_hf_store()
    options = {"endpoint": hub.endpoint, "token": hub.token, "environ": {},
               "uploader": store._uploader, "part_size": 1 << 16}
    truth = _three_steps(store.url, options)
    hub.put(store.bucket_id, f"{store.prefix}/{manifest_path(3)}", GARBAGE)
    f = follower_factory(store.url, {k: torch.zeros_like(v) for k, v in truth[0].items()},
                         poll_interval_s=POLL_S, store_options=options)
    _settled(f, truth)
    hub.log.clear()
    time.sleep(WATCH_S)
    resolves, api = len(hub.requests("resolve")), len(hub.requests("api"))
    assert resolves <= 2 * ROUNDS + 4, resolves  # was 5,000 in 10 s: the quota used up
    assert api <= 2, api  # a listing at most, and an events retry
    assert not [r for r in hub.requests() if r["status"] == 429]
    garbage = [r for r in hub.requests() if r["path"].endswith(manifest_path(3))]
    assert not garbage, garbage  # remembered: neither probed nor read again
    assert manifest_path(3) in f.poller.status().last_error
    _closes_in_time(f)

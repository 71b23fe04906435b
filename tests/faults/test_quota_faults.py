"""Fault matrix, quota burn (item 5): a corrupt step on an hf:// bucket is downloaded a few
times with a growing backoff, not once per poll interval; what failed verification is
remembered, the good steps before it are staged, nothing of the corrupt step is.
"""

from __future__ import annotations

import time
from typing import Any

from tests.helpers.publishing import Trainer
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.format.manifest import fingerprint
from vllm_deltasync.server.worker.poller import Poller


def _publish(store: Any, hub: Any, steps: int) -> dict[str, Any]:
    options = {"endpoint": hub.endpoint, "token": hub.token, "environ": {},
               "uploader": store._uploader, "part_size": 1 << 16}
    trainer = Trainer(seed=5, lr=3e-6)
    with DeltaPublisher(store.url, anchor_every=10, store_options=options) as pub:
        for step in range(steps):
            trainer.step()
            pub.publish(step, trainer.weights)
    return {k: v for k, v in options.items() if k != "uploader"}


def test_corrupt_step_is_not_downloaded_every_poll(hub: Any, make_hf_store: Any) -> None:
    store = make_hf_store()
    options = _publish(store, hub, 3)
    bucket = hub.buckets[store.bucket_id]
    bad = sorted(p for p in bucket if "/data/000000000002-" in p)[0]
    body = bytearray(bucket[bad])
    body[-1] ^= 0xFF
    bucket[bad] = bytes(body)
    hub.log.clear()
    weights = Trainer(seed=5).weights
    fp = fingerprint((n, tuple(w.shape), "bfloat16") for n, w in weights.items())
    poll = 0.1
    poller = Poller(SyncConfig(url=store.url, poll_interval_s=poll, store_options=options),
                    lambda m, p: (p, 1), fingerprint=fp)
    poller.start()
    try:
        time.sleep(3.0)  # 30 poll intervals
        status = poller.status()
    finally:
        poller.close()
    name = bad.rsplit("/", 2)[-2]
    downloads = [r for r in hub.requests("cdn") if name in r["path"]]
    assert 1 <= len(downloads) <= 6, len(downloads)  # 0.2 + 0.4 + 0.8 + 1.6 s of backoff
    assert status.ready_steps == (0, 1)           # the good steps, never the corrupt one
    assert "step 2" in status.last_error
    assert status.counters.failures[0][:2] == ("download", "IntegrityError") or any(
        r == "IntegrityError" for _, r, _ in status.counters.failures)

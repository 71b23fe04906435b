"""A real vLLM engine follows a bucket through mirrors (issue 37 item 1).

The engine starts from the step-0 checkpoint with ``VLLM_DELTASYNC_MIRRORS`` naming two mirrors
in front of the local Hub server: first one that serves corrupt bytes (the right length, one
byte flipped), then a real nginx cache configured from ``deploy/nginx/``. The trainer publishes
real AdamW bf16 steps. After every step the rank's live weights equal the trainer's bit for bit
(nothing the corrupt mirror served was applied), the corrupt mirror was counted and skipped,
the cache served the rest, and the Hub's CDN served each data object once, tokenless.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_model
from tests.helpers.engines import (
    close_llm,
    engine_env,
    make_llm,
    open_bucket,
    requires_vllm,
    wait_applied,
)
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.format.layout import parse_data_path
from vllm_deltasync.server.worker.apply import sha256_hex

STEPS = 3


@requires_vllm
@pytest.mark.engine
def test_engine_follows_through_a_corrupt_mirror_then_a_cache(
        request: pytest.FixtureRequest, tmp_path: Path, make_mirror: Any,
        make_bad_mirror: Any) -> None:
    from tests.helpers.engines import Trainer

    model_dir = build_model(tmp_path / "model", seed=3, family="llama", num_kv_heads=2)
    trainer = Trainer(model_dir, lr=1e-5, seed=3)
    bucket = open_bucket("hf", request, tmp_path)
    hub = bucket.server
    bucket_id, prefix = bucket.url.split("buckets/", 1)[1].rsplit("/", 1)
    bad = make_bad_mirror(lambda key: hub.buckets[bucket_id].get(f"{prefix}/{key}"))
    origin = f"{hub.endpoint}/buckets/{bucket_id}/resolve/{prefix}/"
    cache = make_mirror(origin, f"Bearer {hub.token}")
    env = {**bucket.worker_env, "VLLM_DELTASYNC_MIRRORS": f"{bad.url},{cache.url}"}
    with DeltaPublisher(bucket.url, anchor_every=10, store_options=bucket.publisher_options) as pub, \
            engine_env(tmp_path, 1, env, url=bucket.url, poll_interval_s=0.2, metrics_port=0):
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        llm = make_llm(model_dir, 1, extension=True)
        try:
            wait_applied(llm, 0, timeout_s=90)
            for step in range(1, STEPS + 1):
                trainer.step()
                pub.publish(step, trainer.named_tensors())
                pub.flush()
                statuses = wait_applied(llm, step, timeout_s=90)
                assert all(s["last_error"] is None for s in statuses), statuses
                live = llm.collective_rpc("deltasync_weight_digests")[0]
                for name, tensor in trainer.named_tensors():  # bit for bit, whole tensors
                    assert live[name] == sha256_hex(tensor), (step, name)
            counters = statuses[0]["counters"]
        finally:
            close_llm(llm)

    outcomes = {(m, o): n for m, o, n in counters["mirror_requests"]}
    assert outcomes.get((bad.url, "corrupt"), 0) >= 1, outcomes
    assert outcomes.get((cache.url, "ok"), 0) >= 1, outcomes
    data = [r["path"] for r in hub.requests("cdn")
            if parse_data_path(r["path"].split(f"/{prefix}/", 1)[-1]) is not None]
    assert data and len(data) == len(set(data)), data  # each object from the origin once
    assert hub.cdn_auth_seen == 0
    assert not [r for r in bad.requests if r["auth"] or r["key"].startswith("manifests/")]

"""The bucket format end to end over the network transports: DeltaPublisher writes a chain of
steps to hf:// (local Hub server; uploads through the test uploader seam of tests/conftest.py) or
s3:// (moto), BucketReader rebuilds the newest step, and StepWatcher finds it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.server.worker.discovery import StepWatcher
from vllm_deltasync.trainer.publisher import DeltaPublisher

SHAPES = {"layers.0.weight": (64, 32), "layers.0.bias": (64,), "head.weight": (16, 64)}


@pytest.fixture(params=["hf", "s3"])
def bucket(request: pytest.FixtureRequest, run: Any) -> tuple[str, dict[str, Any]]:
    """(url, store_options) of an empty bucket on the scheme's local server."""
    if request.param == "hf":
        store = request.getfixturevalue("make_hf_store")()
        hub = request.getfixturevalue("hub")
        options = {
            "endpoint": hub.endpoint,
            "token": hub.token,
            "environ": {},
            "uploader": store._uploader,
            "part_size": 1 << 16,
        }
        return store.url, options
    store = request.getfixturevalue("make_s3_store")()
    options = {
        "endpoint_url": store.endpoint_url,
        "region_name": "us-east-1",
        "addressing_style": "path",
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing-secret-key",
    }
    return store.url, options


def test_publish_then_read_back(bucket: tuple[str, dict[str, Any]], run: Any) -> None:
    url, options = bucket
    gen = torch.Generator().manual_seed(int(uuid.uuid4().int % 1000))
    weights = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in SHAPES.items()}
    with DeltaPublisher(url, anchor_every=3, store_options=options) as publisher:
        for step in range(1, 6):
            for tensor in weights.values():  # change ~2% of the elements
                flat = tensor.view(-1)
                picks = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=gen)
                flat[picks] += 0.5
            publisher.publish(step, weights)
        publisher.flush()

    reader = BucketReader.open(url, store_options=options)
    watcher = StepWatcher(reader.store, probe_interval_s=0.1)

    async def read_back() -> tuple[int | None, list[int], dict[str, torch.Tensor]]:
        try:
            newest = await watcher.wait_for_new(None, 10.0)
            return newest, await reader.list_steps(), await reader.read_full(5)
        finally:
            await watcher.close()
            await reader.close()

    newest, steps, state = run(read_back())
    assert newest == 5 and steps == [1, 2, 3, 4, 5]
    for name, tensor in weights.items():
        assert torch.equal(state[name].view(-1), tensor.view(-1)), name

"""s3:// against moto's S3 server: gateway settings, conditional writes, multipart, errors."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from vllm_deltasync.errors import AlreadyExistsError, ConfigError, NotFoundError
from vllm_deltasync.format.layout import manifest_path
from vllm_deltasync.server.worker.discovery import StepWatcher
from vllm_deltasync.stores import open_store
from vllm_deltasync.stores.s3 import S3Store, parse_s3_url


def test_url_forms_and_options() -> None:
    assert parse_s3_url("s3://bkt/a/b/") == ("bkt", "a/b")
    assert parse_s3_url("s3://bkt") == ("bkt", "")
    with pytest.raises(ConfigError, match="s3://<bucket>"):
        open_store("s3:///nobucket")
    with pytest.raises(ConfigError, match="addressing_style"):
        open_store("s3://bkt", addressing_style="sideways")
    gateway = S3Store.hub_gateway("ns", "bkt", "p")
    assert (gateway.endpoint_url, gateway.region_name, gateway.addressing_style) == (
        "https://s3.hf.co/ns",
        "us-east-1",
        "path",
    )


def test_gateway_settings_reach_the_wire(s3_store: S3Store, run: Any) -> None:
    """Path-style URLs, and no checksum headers unless an operation requires them."""
    sent: list[Any] = []

    async def scenario() -> None:
        client = await s3_store._s3()
        client.meta.events.register(
            "before-send.s3.PutObject", lambda request, **_: sent.append(request)
        )
        await s3_store.write("m/1.json", b"{}")

    run(scenario())
    (request,) = sent
    assert f"/{s3_store.bucket}/run/m/1.json" in request.url
    assert not [
        h for h in request.headers if h.lower().startswith(("x-amz-checksum", "x-amz-sdk-checksum"))
    ]
    assert request.headers.get("If-None-Match") in (b"*", "*")


def test_head_then_put_when_conditional_writes_are_off(make_s3_store: Any, run: Any) -> None:
    store = make_s3_store(conditional_writes=False)
    run(store.write("m/1", b"a"))
    with pytest.raises(AlreadyExistsError):
        run(store.write("m/1", b"b"))
    assert run(store.read("m/1")) == b"a"
    assert store.stats.requests[("stat", "ok")] == 1


def test_large_objects_use_multipart(s3_store: S3Store, run: Any) -> None:
    data = os.urandom(13 << 20)
    run(s3_store.write("data/big", data))
    info = run(s3_store.stat("data/big"))
    assert info is not None and info.etag is not None and info.etag.strip('"').endswith("-3")
    with pytest.raises(AlreadyExistsError):
        run(s3_store.write("data/big", data))


def test_missing_bucket_and_secret_hygiene(make_s3_store: Any, s3_endpoint: str, run: Any) -> None:
    store = open_store(
        "s3://no-such-bucket-here/p",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="AKIDEXAMPLE",
        aws_secret_access_key="very-secret-value",
    )
    with pytest.raises(NotFoundError, match="NoSuchBucket"):
        run(store.list())
    assert "very-secret-value" not in repr(store) and "very-secret-value" not in str(vars(store))
    run(store.close())


def test_polling_discovery_on_s3(s3_store: S3Store, run: Any) -> None:
    async def scenario() -> tuple[int | None, int | None, StepWatcher]:
        await s3_store.write(manifest_path(3), b"{}")
        watcher = StepWatcher(s3_store, probe_interval_s=0.1)
        first = await watcher.wait_for_new(None, 5.0)

        async def later() -> None:
            await asyncio.sleep(0.3)
            await s3_store.write(manifest_path(4), b"{}")

        task = asyncio.create_task(later())
        second = await watcher.wait_for_new(3, 5.0)
        await task
        return first, second, watcher

    first, second, watcher = run(scenario())
    assert (first, second) == (3, 4)
    assert watcher.stats.mode == "polling" and watcher.stats.probe_hits == 1

"""Fixtures of the store tests: the local Hub bucket server, moto's S3 server, one store per scheme.

Every test gets its own event loop (``run``) and a fresh bucket; the two servers are started
once per session on loopback. The conformance suite asks for ``store``, parametrized over the
four schemes; transport tests ask for ``hub`` / ``hf_store`` or ``s3_endpoint`` / ``s3_store``.

The Xet upload protocol cannot run offline: ``hf_store`` injects an uploader (the single seam
of ``HfStore``, its ``uploader=`` option) that PUTs the bytes to the local server's test upload
route instead of calling ``huggingface_hub.batch_bucket_files``. Everything else, including
deletes through ``huggingface_hub``'s batch API, speaks the real protocol.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from vllm_deltasync.stores import Store, open_store
from vllm_deltasync.stores.hf import HfStore
from vllm_deltasync.stores.memory import MemoryStore
from vllm_deltasync.stores.s3 import S3Store

T = TypeVar("T")

_spec = importlib.util.spec_from_file_location(
    "deltasync_hubserver", Path(__file__).with_name("hubserver.py")
)
assert _spec is not None and _spec.loader is not None
hubserver = importlib.util.module_from_spec(_spec)
sys.modules["deltasync_hubserver"] = hubserver
_spec.loader.exec_module(hubserver)
HubServer = hubserver.HubServer
Quota = hubserver.Quota

SCHEMES = ["file", "memory", "hf", "s3"]


@pytest.fixture
def run() -> Iterator[Callable[[Awaitable[T]], T]]:
    """Run a coroutine on this test's own event loop (stores keep sessions bound to it)."""
    loop = asyncio.new_event_loop()

    def go(coro: Awaitable[T], timeout_s: float = 60.0) -> T:
        return loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    yield go
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


# -- local Hub bucket server ------------------------------------------------------------------


@pytest.fixture(scope="session")
def hub_server() -> Iterator[Any]:
    with HubServer(page_size=3) as server:
        yield server


@pytest.fixture
def hub(hub_server: Any) -> Iterator[Any]:
    """The session's Hub server with its switches, quotas and logs reset for this test."""
    hub_server.faults = hubserver.Faults()
    hub_server.quotas = {"api": Quota(1000, 300.0), "resolve": Quota(5000, 300.0)}
    hub_server.log.clear()
    hub_server.cdn_auth_seen = 0
    hub_server.cdn_bytes_served = 0
    yield hub_server


def local_uploader(
    hub: Any, bucket_id: str
) -> Callable[[list[tuple[str, bytes]]], Awaitable[None]]:
    """Stand-in for the Xet upload: PUT each object to the local server's test route."""

    async def upload(items: list[tuple[str, bytes]]) -> None:
        async with aiohttp.ClientSession() as session:
            for path, data in items:
                url = f"{hub.endpoint}/_test/upload/{bucket_id}/{path}"
                async with session.put(
                    url, data=data, headers={"Authorization": f"Bearer {hub.token}"}
                ) as r:
                    r.raise_for_status()

    return upload


@pytest.fixture
def make_hf_store(hub: Any, run: Any) -> Iterator[Callable[..., HfStore]]:
    """``make_hf_store(**options)``: an ``HfStore`` on a fresh bucket of the local server."""
    made: list[HfStore] = []

    def make(prefix: str = "run", bucket_id: str | None = None, **options: Any) -> HfStore:
        bucket_id = bucket_id or f"tester/b-{uuid.uuid4().hex[:8]}"
        hub.create_bucket(bucket_id)
        settings: dict[str, Any] = {
            "endpoint": hub.endpoint,
            "token": hub.token,
            "environ": {},
            "uploader": local_uploader(hub, bucket_id),
            "part_size": 1 << 16,
            "max_parallel_parts": 4,
        }
        store = open_store(f"hf://buckets/{bucket_id}/{prefix}", **{**settings, **options})
        assert isinstance(store, HfStore)
        made.append(store)
        return store

    yield make
    for store in made:
        run(store.close())


@pytest.fixture
def hf_store(make_hf_store: Callable[..., HfStore]) -> HfStore:
    return make_hf_store()


# -- moto S3 server ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


S3_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing-secret-key"}


@pytest.fixture
def make_s3_store(s3_endpoint: str, run: Any) -> Iterator[Callable[..., S3Store]]:
    """``make_s3_store(**options)``: an ``S3Store`` on a fresh bucket of moto's server."""
    made: list[S3Store] = []

    def make(prefix: str = "run", **options: Any) -> S3Store:
        bucket = f"b-{uuid.uuid4().hex[:12]}"
        settings: dict[str, Any] = {
            "endpoint_url": s3_endpoint,
            "region_name": "us-east-1",
            "addressing_style": "path",
            "part_size": 5 << 20,
            "multipart_threshold": 6 << 20,
            **S3_CREDENTIALS,
        }
        store = open_store(f"s3://{bucket}/{prefix}", **{**settings, **options})
        assert isinstance(store, S3Store)

        async def create() -> None:
            client = await store._s3()
            await client.create_bucket(Bucket=bucket)

        run(create())
        made.append(store)
        return store

    yield make
    for store in made:
        run(store.close())


@pytest.fixture
def s3_store(make_s3_store: Callable[..., S3Store]) -> S3Store:
    return make_s3_store()


# -- one store per scheme, for the conformance suite -------------------------------------------


@pytest.fixture(params=SCHEMES)
def store(request: pytest.FixtureRequest, tmp_path: Path, run: Any) -> Iterator[Store]:
    """The store under test; each scheme supplies only how to open one."""
    scheme = request.param
    if scheme == "file":
        made: Store = open_store(f"file://{tmp_path}/bucket")
    elif scheme == "memory":
        made = open_store(f"memory://conformance-{uuid.uuid4().hex[:8]}")
    elif scheme == "hf":
        made = request.getfixturevalue("make_hf_store")()
    else:
        made = request.getfixturevalue("make_s3_store")()
    yield made
    if scheme in ("file", "memory"):
        run(made.close())
    if isinstance(made, MemoryStore):
        MemoryStore.drop(made.name)


@pytest.fixture
def large_size(store: Store) -> int:
    """An object size that spans several parallel parts on the network stores."""
    return 11 << 20 if isinstance(store, S3Store) else (5 << 16) + 123

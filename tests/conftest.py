"""Fixtures shared by every test folder: a per-test event loop, the local Hub bucket server,
moto's S3 server, and mirrors in front of them (a real nginx cache, mirrors that fail); an empty
``file://`` bucket and a fresh metrics registry; the host's engine probes, which skip a test
saying why. The servers, the host checks and the credentials are in ``tests/helpers/``.

The two servers are started once per session on loopback; each test gets a fresh bucket
(``make_hf_store`` / ``make_s3_store``) and the Hub server's fault switches, quotas and logs
reset (``hub``). The store tests use them for the conformance suite and transport tests, the
engine tests to serve a bucket a real vLLM engine follows.

The Xet upload protocol cannot run offline: ``make_hf_store`` injects an uploader (the single
seam of ``HfStore``, its ``uploader=`` option) that PUTs the bytes to the local server's test
upload route instead of calling ``huggingface_hub.batch_bucket_files``. Everything else,
including deletes through ``huggingface_hub``'s batch API, speaks the real protocol.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client import CollectorRegistry

from tests.helpers import hubserver, mirrorserver
from tests.helpers.hosts import STARTUP, require_engine
from tests.helpers.transports import S3_CREDENTIALS, local_uploader
from vllm_deltasync.stores import open_store
from vllm_deltasync.stores.hf import HfStore
from vllm_deltasync.stores.s3 import S3Store

if str(STARTUP) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(STARTUP), os.environ.get("PYTHONPATH")) if p)

# Engines in tests run the in-place kernels GPUs use (the CPU default packs them:
# SyncConfig.cpu_kernels); subprocesses inherit this. tests/engine/test_packed.py and
# tests/server/worker/test_packed.py run the packed mode. Set the variable to run every engine
# test in the packed mode instead.
os.environ.setdefault("VLLM_DELTASYNC_CPU_KERNELS", "inplace")

T = TypeVar("T")


# -- the order modules run in ------------------------------------------------------------------


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules that start engines or torchrun jobs first, the quick ones last (order within a
    module kept): ``make test`` hands whole modules to its pytest-xdist workers in this order
    (``--dist loadfile --no-loadscope-reorder``), so while one worker ends a long engine module
    the other fills the time with short ones instead of waiting."""
    def heavy(item: pytest.Item) -> int:
        return 0 if any(item.get_closest_marker(m) for m in ("engine", "distributed")) else 1

    modules: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        modules[module] = min(modules.get(module, 1), heavy(item))
    position = {m: i for i, m in enumerate(modules)}
    items.sort(key=lambda item: (modules[item.nodeid.split("::", 1)[0]],
                                 position[item.nodeid.split("::", 1)[0]]))


# -- the host: the stock engines it runs (README, Development: hosts) -------------------------


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every ``engine`` test builds its engines from the toy models (head size 32): it skips,
    saying why, on a host where a stock engine of the toy Llama dies of SIGILL. Runs after
    the skip marks (``requires_vllm``), before the test's fixtures start anything."""
    if item.get_closest_marker("engine") is not None:
        require_engine("toy")


@pytest.fixture(scope="session")
def host_runs_draft_model() -> None:
    """Skips the tests using it where a stock draft-model speculative engine dies of SIGILL."""
    require_engine("draft_model")


@pytest.fixture(scope="session")
def host_runs_lora() -> None:
    """Skips the tests using it where a stock ``--enable-lora`` engine serving an adapter dies
    of SIGILL (vLLM's CPU LoRA kernels)."""
    require_engine("lora")


@pytest.fixture(scope="session")
def host_runs_moe() -> None:
    """Skips the tests using it where a stock engine of a toy MoE model dies of SIGILL."""
    require_engine("moe")


# -- a bucket, a registry, an event loop ------------------------------------------------------


@pytest.fixture
def bucket(tmp_path: Path) -> str:
    """An empty ``file://`` bucket in this test's directory."""
    return f"file://{tmp_path / 'bucket'}"


@pytest.fixture
def registry() -> CollectorRegistry:
    """A fresh Prometheus registry (metric objects take ``registry=``)."""
    return CollectorRegistry()


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
    with hubserver.HubServer(page_size=3) as server:
        yield server


@pytest.fixture
def hub(hub_server: Any) -> Iterator[Any]:
    """The session's Hub server with its switches, quotas and logs reset for this test."""
    hub_server.faults = hubserver.Faults()
    hub_server.quotas = {"api": hubserver.Quota(1000, 300.0),
                         "resolve": hubserver.Quota(5000, 300.0)}
    hub_server.log.clear()
    hub_server.cdn_auth_seen = 0
    hub_server.cdn_bytes_served = 0
    yield hub_server


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


# -- mirrors ----------------------------------------------------------------------------------


@pytest.fixture
def make_mirror() -> Iterator[Callable[..., Any]]:
    """``make_mirror(origin, authorization="")``: nginx on loopback as a caching mirror of
    ``origin`` (the base URL object keys are appended to), configured from deploy/nginx/'s
    template, in its own directory with its own cache; stopped after the test."""
    if mirrorserver.nginx_binary() is None:
        pytest.skip("nginx is not installed (scripts/setup.sh installs Debian's nginx-light)")
    made: list[Any] = []

    def make(origin: str, authorization: str = "") -> Any:
        mirror = mirrorserver.NginxMirror(origin, authorization)
        mirror.start()
        made.append(mirror)
        return mirror

    yield make
    for mirror in made:
        mirror.stop()


@pytest.fixture
def make_bad_mirror() -> Iterator[Callable[..., Any]]:
    """``make_bad_mirror(source, mode)``: a mirror that fails on purpose (``corrupt``, ``hang``,
    ``trickle``; tests/helpers/mirrorserver.py ``BadMirror``), recording what it was asked."""
    made: list[Any] = []

    def make(source: Callable[[str], bytes | None], mode: str = "corrupt", **kw: Any) -> Any:
        mirror = mirrorserver.BadMirror(source, mode, **kw).__enter__()
        made.append(mirror)
        return mirror

    yield make
    for mirror in made:
        mirror.__exit__(None, None, None)


@pytest.fixture
def dead_mirror() -> str:
    """A loopback mirror URL nothing listens on (connections are refused)."""
    return mirrorserver.dead_mirror_url()

"""Fixtures shared by every test folder: a per-test event loop, the local Hub bucket server,
moto's S3 server, and mirrors in front of them (a real nginx cache, mirrors that fail).

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
import importlib.util
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from vllm_deltasync.stores import open_store
from vllm_deltasync.stores.hf import HfStore
from vllm_deltasync.stores.s3 import S3Store

from .host_probe import KINDS
from .stores import hubserver, mirrorserver


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_LOW = _ephemeral_low()


def free_port(n: int = 1) -> int:
    """A loopback port p with p..p+n-1 free right now, picked below the kernel's ephemeral
    range. vLLM and every client bind their own ports from that range (port 0), so one of them
    can take a port picked there between the pick and our server's bind; a metrics port once was
    taken so in CI ("Address already in use"), and a data-parallel metrics range once more.
    Falls back to the ephemeral range if no run of n ports is free below."""
    rng = random.Random()
    top = max(_EPHEMERAL_LOW, 20100) - n
    for _ in range(200):
        base = rng.randrange(20000, top) if top > 20000 else rng.randrange(1024, 65536 - n)
        socks: list[socket.socket] = []
        try:
            for i in range(n):
                sk = socket.socket()
                socks.append(sk)
                sk.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for sk in socks:
                sk.close()
    raise RuntimeError(f"no run of {n} free loopback ports")


T = TypeVar("T")


# -- the host: its CPU, AMX tiles, the stock engines it runs (README, Development: hosts) ----

REPO = Path(__file__).resolve().parents[1]
STARTUP = REPO / "tests" / "startup"
"""Holds the ``sitecustomize`` every child Python of a test run starts with (AMX tiles)."""


def _request_amx_tiles() -> bool | None:
    spec = importlib.util.spec_from_file_location("tests_startup", STARTUP / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.request_amx_tiles()  # type: ignore[no-any-return]


AMX_TILES = _request_amx_tiles()
"""This process asked Linux for AMX tiles (engines built in the test process run vLLM's AMX
kernels here): True granted, False refused, None nothing to ask for (no AMX)."""
if str(STARTUP) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(STARTUP), os.environ.get("PYTHONPATH")) if p)


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of ``/proc/cpuinfo`` text (its first ``flags`` line)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def describe_host(flags: frozenset[str], amx_tiles: bool | None) -> str:
    """The kind of host, as the README's table of hosts names it, from its CPU flags and what
    Linux answered when asked for AMX tiles."""
    if "amx_tile" in flags:
        tiles = {True: "tile data granted", False: "tile data refused by Linux",
                 None: "no tile data offered by Linux"}[amx_tiles]
        return f"AVX-512 with AMX ({tiles})"
    if "avx512f" in flags:
        return "AVX-512 without AMX" + ("" if "avx512_bf16" in flags else ", no avx512_bf16")
    if "avx2" in flags:
        return "AVX2 only, no AVX-512"
    return f"{os.uname().machine}, no AVX2"


def _host_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


HOST_FLAGS = _host_flags()
HOST = describe_host(HOST_FLAGS, AMX_TILES)
"""This host's kind, as skip reasons name it (README, Development: hosts)."""

NO_PACKING = (f"vLLM's CPU build packs no bf16 linear weight on this host ({HOST}; without "
              "AVX-512 oneDNN makes no bf16 matmul primitive and vLLM falls back to torch's "
              "linear on the parameter), so there is no packed copy for the packed mode to "
              "refresh")


@dataclass(frozen=True)
class EngineProbe:
    """What a stock engine of one kind did on this host (tests/host_probe.py)."""

    kind: str
    returncode: int | None
    """The probe's exit status, negative for the signal that killed it; None: it timed out."""
    log: str
    """The end of its output (faulthandler's frames where it died of a signal)."""

    @property
    def skip_reason(self) -> str | None:
        """Why tests needing this kind skip here: only a CPU trap (SIGILL) is the host's
        doing; any other failure is left to the tests, which fail and say why."""
        if self.returncode != -signal.SIGILL:
            return None
        # faulthandler's frames, innermost first; the innermost of vLLM's names the kernel
        frames = re.findall(r'File "(?:.*/site-packages/)?([^"]+)", line (\d+) in (\S+)',
                            self.log)
        frame = next((f for f in frames if f[0].startswith("vllm/")), frames[0] if frames else None)
        where = f" in {frame[2]} ({frame[0]}:{frame[1]})" if frame else ""
        return (f"this host ({HOST}) traps an instruction of vLLM's CPU kernels: a stock vLLM "
                f"engine of {KINDS[self.kind]}, without the deltasync plugin, died of SIGILL"
                f"{where} (README, Development: hosts)")


_PROBES: dict[str, EngineProbe] = {}


def engine_probe(kind: str) -> EngineProbe:
    """Run a stock engine of ``kind`` (tests/host_probe.py) in a child process, once per test
    session: ~25 s where it works, paid only when a test that needs the kind runs."""
    if kind not in _PROBES:
        _PROBES[kind] = _run_probe(kind)
    return _PROBES[kind]


def _run_probe(kind: str) -> EngineProbe:
    with tempfile.TemporaryDirectory(prefix="probe") as work:  # short: vLLM's socket paths
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DELTASYNC_")}
        env.update({
            "VLLM_PLUGINS": "no-plugin-has-this-name",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0",
            "VLLM_CACHE_ROOT": f"{work}/cache",
            "VLLM_RPC_BASE_PATH": work,
            "TOKENIZERS_PARALLELISM": "false",
        })
        try:
            proc = subprocess.run([sys.executable, "-m", "tests.host_probe", kind, work],
                                  cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=300, check=False)
        except subprocess.TimeoutExpired as exc:
            return EngineProbe(kind, None, str(exc.stderr or "")[-3000:])
    return EngineProbe(kind, proc.returncode, (proc.stdout + proc.stderr)[-3000:])


def require_engine(kind: str) -> None:
    """Skip the running test, saying why, where a stock engine of ``kind`` dies of SIGILL."""
    reason = engine_probe(kind).skip_reason
    if reason:
        pytest.skip(reason)


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


def vllm_cpu_dispatch() -> Any:
    """vLLM's own ``dispatch_cpu_unquantized_gemm`` (the one our plugin's patch wraps, if
    installed in this process). Imports vLLM."""
    import vllm.model_executor.layers.utils as layer_utils

    dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    return getattr(dispatch, "_deltasync_original", dispatch)


def vllm_packs_bf16_linears() -> bool:
    """Whether vLLM's own CPU GEMM dispatch, on this host, makes bf16 linear layers compute
    from a packed copy of their weight (the packed mode's tests need one). Imports vLLM."""
    from types import SimpleNamespace

    import torch

    from vllm_deltasync.server.vllm.cpu_gemm import reads_its_weight

    weight = torch.nn.Parameter(torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
                                .to(torch.bfloat16), requires_grad=False)
    layer = SimpleNamespace(weight=weight, bias=None, cpu_linear=None)
    vllm_cpu_dispatch()(layer, False)
    return not reads_its_weight(layer.cpu_linear, weight)

# Engines in tests run the in-place kernels GPUs use (the CPU default packs them:
# SyncConfig.cpu_kernels); subprocesses inherit this. tests/engine/test_packed.py and
# tests/shardmap/test_packed.py run the packed mode. Set the variable to run every engine
# test in the packed mode instead.
os.environ.setdefault("VLLM_DELTASYNC_CPU_KERNELS", "inplace")
HubServer = hubserver.HubServer
Quota = hubserver.Quota


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
    ``trickle``; tests/stores/mirrorserver.py ``BadMirror``), recording what it was asked."""
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


def hub_origin(hub: Any, store: HfStore) -> tuple[str, str]:
    """What a mirror of ``store`` (on the local Hub server) fetches from: the resolve base URL
    of its prefix and the ``Authorization`` the mirror sends there."""
    tail = f"{store.prefix}/" if store.prefix else ""
    return (f"{hub.endpoint}/buckets/{store.bucket_id}/resolve/{tail}",
            f"Bearer {hub.token}")

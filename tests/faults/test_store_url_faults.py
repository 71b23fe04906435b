"""Fault matrix, the red team's store and URL findings (issue 23 item 5): each is refused or
survived in one line naming the object and the fix, with nothing wrong applied.

1. credentials: ``status`` never puts ``user:password@`` into a host name lookup or a message;
   ``s3:K:S@b/p``, ``hf:buckets/...`` and every known scheme without ``//`` are malformed URLs
   (refused without echoing them), never local paths;
2. hangs: a FIFO, socket or device in place of a file:// object is refused by name; a symlink
   loop or cycle under ``manifests/`` neither hangs nor crashes a listing;
3. resources: a manifest that is ``/dev/zero``, ``/dev/urandom`` or a 1 GiB sparse file is
   refused at the cap before anything of that size is read or allocated; a redirect host is
   looked up once, and the address checked is the address connected to;
4. messages: the hf:// not-found line names the endpoint (never ``<unparsable url>``); a full
   disk while writing a file:// bucket is a StoreError naming the path.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.helpers.faults import (
    PLANTED,
    Hostile,
    LookupLog,
    assert_no_secret,
    cli,
    one_line_error,
    root_of,
)
from vllm_deltasync import BucketReader
from vllm_deltasync._urls import redact_text, redact_url
from vllm_deltasync.errors import (
    ConfigError,
    FormatError,
    NotFoundError,
    StoreError,
)
from vllm_deltasync.format.manifest import MAX_MANIFEST_BYTES
from vllm_deltasync.stores import open_store
from vllm_deltasync.stores.local import LocalStore

KEY, SECRET, SESSION, TOKEN = PLANTED
MANIFEST = "manifests/000000000003.json"


# -- 1. credentials --------------------------------------------------------------------------


def test_status_never_looks_up_or_shows_userinfo(
        hostile: Hostile, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A metrics URL with userinfo is refused before any lookup or request (issue 36: the
    authority cannot be told from a secret with '/' in it); the same server without it
    answers."""
    seen: list[str | None] = []

    async def metrics(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.Response(text='deltasync_applied_step{rank="0"} 4\n'
                                 'deltasync_newest_step{rank="0"} 4\n')

    hostile.on("GET", "/metrics", metrics)
    lookups = LookupLog(monkeypatch)
    port = hostile.url.rsplit(":", 1)[1]
    for bad in (f"u:{SECRET}@127.0.0.1:{port}",
                f"http://{KEY}:{SECRET}@127.0.0.1:1/metrics?token={TOKEN}"):
        rc, out, err = cli(capsys, "status", bad)
        assert rc == 1 and "may carry a credential" in err and not out
        assert seen == [] and lookups.hosts == []
        assert_no_secret(out, err)
    rc, out, err = cli(capsys, "status", f"127.0.0.1:{port}")
    assert rc == 0 and f"http://127.0.0.1:{port}/metrics  applied=4" in out
    assert seen == [None]


MALFORMED = {
    "s3-no-slashes": f"s3:{KEY}:{SECRET}@b/p",
    "s3-one-slash": f"s3:/{KEY}:{SECRET}@b/p",
    "s3-empty-authority": f"s3:///{KEY}:{SECRET}@b/p",
    "s3-upper": f"S3:{KEY}:{SECRET}@b/p",
    "hf-no-slashes": "hf:buckets/ns/name/p",
    "hf-one-slash": f"hf:/user:{TOKEN}@buckets/ns/name",
    "hf-empty-authority": "hf:///buckets/ns/name",
    "file-no-slashes": "file:relative/bucket",
    "memory-no-slashes": "memory:name",
    "gs-no-slashes": f"gs:{KEY}:{SECRET}@b/p",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_scheme_without_slashes_is_malformed_not_a_path(
        case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        all_logs: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    url = MALFORMED[case]
    with pytest.raises(ConfigError) as err:
        open_store(url)
    msg = str(err.value)
    assert "malformed" in msg and len(msg.splitlines()) == 1
    scheme = url.split(":", 1)[0].lower()
    if scheme in ("s3", "hf", "file", "memory"):
        assert f"use {scheme}://" in msg  # names the form to use
    if "@" in url:
        assert "never in the URL" in msg  # and where credentials go
    assert redact_text(msg) == msg  # the CLI's one-line redaction keeps the hint intact
    assert_no_secret(msg, redact_url(url), redact_text(f"failed: {url} ."), all_logs.text)
    assert list(tmp_path.iterdir()) == []  # nothing was created as a local directory


def test_bare_paths_and_other_colons_are_still_paths(tmp_path: Path, run: Any) -> None:
    """A real directory whose name has a colon but no known scheme stays a local bucket."""
    folder = tmp_path / "run:7"
    store = open_store(str(folder))
    assert isinstance(store, LocalStore)
    run(store.write("a", b"x"))
    assert run(store.read("a")) == b"x"


def test_redaction_keeps_urls_that_end_a_sentence() -> None:
    text = (f"bucket 'ns/x' not found at http://127.0.0.1:8080; check it, or http://h:1/p?"
            f" ok s3:///{KEY}:{SECRET}@b/p and http://u:{SECRET}@h:2/a?t={TOKEN}.")
    shown = redact_text(text)
    assert "http://127.0.0.1:8080; check it" in shown and "<unparsable" not in shown
    assert "http://h:1/p?" in shown and "http://h:2/a?<redacted>." in shown
    assert_no_secret(shown, redact_url(f"http://u:{SECRET}@[::1:80/x"))


# -- 2. hangs --------------------------------------------------------------------------------


def _replace(path: Path, make: Any) -> None:
    path.unlink()
    make(path)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cwd = os.getcwd()
    os.chdir(path.parent)  # a relative name: tmp paths are longer than AF_UNIX allows
    try:
        sock.bind(path.name)  # left open: a socket file nobody accepts on
    finally:
        os.chdir(cwd)
    _SOCKETS.append(sock)


_SOCKETS: list[socket.socket] = []


def _device(path: Path) -> None:
    path.symlink_to("/dev/null")


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
def test_non_regular_object_is_refused_not_waited_on(
        kind: str, small_bucket: tuple[str, Any], run: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = small_bucket
    root = root_of(url)
    data = sorted((root / "data").rglob("*.safetensors"))[0]
    make = {"fifo": _fifo, "socket": _socket, "device": _device}[kind]
    _replace(data, make)
    _replace(root / MANIFEST, make)
    store = open_store(url)
    started = time.monotonic()
    for rel in (str(data.relative_to(root)), MANIFEST):
        with pytest.raises(StoreError, match="not a regular file|cannot open") as err:
            run(store.read(rel), timeout_s=10)
        assert rel in str(err.value)

    async def manifest() -> Any:
        async with BucketReader.open(url) as reader:
            return await reader.manifest(3)

    with pytest.raises(StoreError, match=MANIFEST):
        run(manifest(), timeout_s=10)
    rc, _, err_text = cli(capsys, "verify", url)
    assert rc != 0 and "Traceback" not in err_text
    assert time.monotonic() - started < 10
    for sock in _SOCKETS:
        sock.close()
    _SOCKETS.clear()


def test_symlink_loops_under_manifests_neither_hang_nor_crash_a_listing(
        small_bucket: tuple[str, Any], run: Any, all_logs: pytest.LogCaptureFixture) -> None:
    url, _ = small_bucket
    manifests = root_of(url) / "manifests"
    (manifests / "000000000009.json").symlink_to("000000000009.json")  # a -> a (ELOOP)
    (manifests / "a").symlink_to("b")
    (manifests / "b").symlink_to("a")
    (manifests / "cycle").symlink_to(".")  # a directory cycle: manifests/cycle/cycle/...
    (manifests / "up").symlink_to("..")
    store = open_store(url)
    started = time.monotonic()
    listed = [o.path for o in run(store.list("manifests/"), timeout_s=10)]
    assert listed == [f"manifests/{s:012d}.json" for s in range(4)]
    assert time.monotonic() - started < 5
    skipped = [r for r in all_logs.records if "skipped by listing" in r.getMessage()]
    assert len(skipped) == 3  # the three unresolvable links, one line each
    run(store.list("manifests/"))  # and not again at the next listing of this store
    assert len([r for r in all_logs.records if "skipped by listing" in r.getMessage()]) == 3

    async def steps() -> list[int]:
        async with BucketReader.open(url) as reader:
            return await reader.list_steps()

    assert run(steps()) == [0, 1, 2, 3]
    with pytest.raises(StoreError, match="000000000009.json: cannot stat"):
        run(store.stat("manifests/000000000009.json"))
    with pytest.raises(StoreError, match="000000000009.json: cannot open"):
        run(store.read("manifests/000000000009.json"))


# -- 3. resources ----------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/urandom", "sparse"])
def test_endless_or_huge_manifest_is_refused_at_the_cap(
        target: str, small_bucket: tuple[str, Any], run: Any, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = small_bucket
    manifest = root_of(url) / MANIFEST
    manifest.unlink()
    if target == "sparse":
        with open(manifest, "wb") as fh:
            fh.truncate(1 << 30)  # 1 GiB, no block allocated
    else:
        manifest.symlink_to(target)

    async def read() -> Any:
        async with BucketReader.open(url) as reader:
            return await reader.manifest(3)

    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises((FormatError, StoreError)) as err:
            run(read(), timeout_s=10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 5
    assert peak < 8 << 20, peak  # nothing of the claimed size was allocated
    msg = str(err.value)
    assert MANIFEST in msg
    if target == "sparse":
        assert isinstance(err.value, FormatError)
        assert f"{1 << 30} bytes, over the {MAX_MANIFEST_BYTES}-byte cap" in msg
    else:
        assert "not a regular file (a character device)" in msg
    rc, out, err_text = cli(capsys, "inspect", url)  # the listing skips it (one log line)
    assert "Traceback" not in err_text and "steps 0..2" in out


def test_node_cache_passes_the_cap_on(tmp_path: Path, run: Any) -> None:
    from vllm_deltasync.stores.nodecache import NodeCachedStore, cache_root

    url = f"file://{tmp_path}/bucket"
    inner = open_store(url)
    run(inner.write(MANIFEST, b"x" * 100))
    run(inner.write("data/a.bin", b"y" * 100))
    store = NodeCachedStore(open_store(url), cache_root(tmp_path / "shm", url, session="1"))
    with pytest.raises(FormatError, match="over the 99-byte cap"):
        run(store.read(MANIFEST, max_bytes=99))
    with pytest.raises(FormatError, match="over the 50-byte cap"):
        run(store.read("data/a.bin", max_bytes=50))
    assert run(store.read(MANIFEST, max_bytes=100)) == b"x" * 100


class Rebinding:
    """A resolver whose answer for one host name changes after the first lookup (DNS
    rebinding): first a loopback address (allowed from a loopback origin), then the cloud
    metadata address. Every other name goes to the real resolver."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, host: str) -> None:
        self.host = host
        self.lookups = 0
        real = socket.getaddrinfo

        def lookup(name: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
            if name != host:
                return real(name, port, *args, **kwargs)
            self.lookups += 1
            address = "127.0.0.1" if self.lookups == 1 else "169.254.169.254"
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port or 0)))]

        monkeypatch.setattr(socket, "getaddrinfo", lookup)


def test_redirect_host_is_connected_at_the_address_that_was_checked(
        hostile: Hostile, run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    host = f"cdn-{uuid.uuid4().hex[:8]}.rebind.test"
    port = hostile.url.rsplit(":", 1)[1]
    seen_hosts: list[str] = []

    async def resolve(request: web.Request) -> web.Response:
        return web.Response(status=302, headers={
            "Location": f"http://{host}:{port}/cdn/x?sig=1", "X-Linked-Size": "5"})

    async def cdn(request: web.Request) -> web.Response:
        seen_hosts.append(request.headers.get("Host", ""))
        return web.Response(body=b"hello", headers={"Content-Range": "bytes 0-4/5"}, status=206)

    hostile.on("HEAD", "/buckets/ns/name/resolve/p/data/x.bin", resolve)
    hostile.on("GET", "/cdn/x", cdn)
    rebinding = Rebinding(monkeypatch, host)
    store = open_store("hf://buckets/ns/name/p", endpoint=hostile.url, token="hf_x", environ={})
    try:
        assert run(store.read("data/x.bin"), timeout_s=20) == b"hello"
        store._located.clear()  # type: ignore[attr-defined]  # a second resolve, same host
        assert run(store.read("data/x.bin"), timeout_s=20) == b"hello"
    finally:
        run(store.close())
    assert rebinding.lookups == 1  # checked once; the connection went to that address
    assert seen_hosts == [f"{host}:{port}"] * 2  # the CDN saw its own name in Host


# -- 4. messages -----------------------------------------------------------------------------


def test_hf_not_found_names_the_endpoint_and_bucket(
        hub: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub.token)
    bucket = f"tester/missing-{uuid.uuid4().hex[:6]}"
    for verb in ("inspect", "verify"):
        rc, out, err = cli(capsys, verb, f"hf://buckets/{bucket}/p")
        one_line_error(rc, err)
        assert "<unparsable" not in err
        assert hub.endpoint in err and f"hf://buckets/{bucket}/p" in err, err
    assert hub.token not in out + err


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Any:
    folder = tmp_path / "tiny"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 64 KiB tmpfs to fill ({done.stderr.strip()[:200]}): "
                    "needs root or CAP_SYS_ADMIN")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_disk_full_while_writing_is_one_store_error(tiny_disk: Path, run: Any) -> None:
    store = LocalStore(tiny_disk / "bucket")
    run(store.write("manifests/000000000000.json", b"{}"))
    with pytest.raises(StoreError) as err:
        run(store.write("data/000000000001-ab/00000.safetensors", os.urandom(256 << 10)))
    msg = str(err.value)
    assert "data/000000000001-ab/00000.safetensors" in msg and "disk is full" in msg
    assert len(msg.splitlines()) == 1
    with pytest.raises(NotFoundError):  # nothing published under the name
        run(store.read("data/000000000001-ab/00000.safetensors"))
    leftovers = [p.name for p in (tiny_disk / "bucket").rglob("*") if p.name.startswith(".tmp-")]
    assert leftovers == []  # the temporary file was removed
    assert run(store.read("manifests/000000000000.json")) == b"{}"


def test_refused_reads_leak_no_file_descriptor(tmp_path: Path, run: Any) -> None:
    """The read path's file descriptor is closed on every outcome (no leak for 200 refusals)."""
    store = LocalStore(tmp_path / "b")
    os.makedirs(tmp_path / "b" / "manifests")
    os.mkfifo(tmp_path / "b" / MANIFEST)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(200):
        with pytest.raises(StoreError):
            run(store.read(MANIFEST))
    assert len(os.listdir("/proc/self/fd")) <= before + 2

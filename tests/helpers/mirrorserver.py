"""Mirrors for the tests and the fleet benchmark: a real nginx cache, and mirrors that fail.

Started by the mirror fixtures of ``tests/conftest.py`` (and loaded by path by
``benchmarks/bench_fleet.py``); it is not a test module.

* :class:`NginxMirror`: nginx on loopback, configured from ``deploy/nginx/``'s template (the
  config users deploy is the one tested), in its own temporary directory with its own cache.
  ``origin_fetches()`` reads its fetch side's access log: one line per request that reached the
  origin through the mirror.
* :class:`BadMirror`: an aiohttp server that fails on purpose (``corrupt``: the right length,
  one byte flipped; ``hang``: accepts and never answers; ``trickle``: a few bytes a second).
  It records every request (path and whether an ``Authorization`` header came along).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from aiohttp import web

from .loopserver import LoopServer

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "deltasync-mirror.conf.template"
_VAR = re.compile(r"\$\{(MIRROR_[A-Z_]+)\}")
_LOG = "$server_port $request_method $uri $status $upstream_cache_status $body_bytes_sent"


def nginx_binary() -> str | None:
    """The nginx binary, or None (scripts/setup.sh installs Debian's ``nginx-light``)."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)


def render(values: dict[str, str]) -> str:
    """deploy/nginx's template with its ``${MIRROR_*}`` variables replaced (what the nginx
    image's envsubst does); a variable without a value is an error."""
    return _VAR.sub(lambda m: values[m.group(1)], TEMPLATE.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NginxMirror:
    """``with NginxMirror(origin, authorization) as m: m.url``: a caching mirror of ``origin``
    (the base URL keys are appended to) on loopback."""

    def __init__(self, origin: str, authorization: str = "", *, port: int | None = None,
                 workers: int = 1) -> None:
        binary = nginx_binary()
        if binary is None:
            raise FileNotFoundError("nginx is not installed (scripts/setup.sh installs nginx-light)")
        self.binary = binary
        self.origin = origin if origin.endswith("/") else origin + "/"
        self.authorization = authorization
        self.port = port or _free_port()
        self.fetch_port = _free_port()
        self.workers = workers
        self.dir = Path(tempfile.mkdtemp(prefix="deltasync-nginx-"))
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> NginxMirror:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        site = render({
            "MIRROR_LISTEN": f"127.0.0.1:{self.port}",
            "MIRROR_FETCH_PORT": str(self.fetch_port),
            "MIRROR_ORIGIN": self.origin,
            "MIRROR_ORIGIN_AUTHORIZATION": self.authorization,
            "MIRROR_RESOLVER": "127.0.0.1",
            "MIRROR_CACHE_DIR": str(self.dir / "cache"),
            "MIRROR_CACHE_SIZE": "2g",
            "MIRROR_CA_FILE": _ca_file(),
        })
        (self.dir / "site.conf").write_text(site)
        temps = "\n".join(f"    {kind}_temp_path {self.dir / kind};"
                          for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        user = "user root;\n" if os.geteuid() == 0 else ""  # workers can write the temp dir
        (self.dir / "nginx.conf").write_text(
            f"{user}worker_processes {self.workers};\ndaemon off;\npid {self.dir / 'nginx.pid'};\n"
            f"error_log {self.dir / 'error.log'} warn;\n"
            "events { worker_connections 4096; }\n"
            f"http {{\n    log_format mirror '{_LOG}';\n"
            f"    access_log {self.dir / 'access.log'} mirror;\n{temps}\n"
            f"    include {self.dir / 'site.conf'};\n}}\n")
        self._proc = subprocess.Popen(
            [self.binary, "-p", str(self.dir), "-c", str(self.dir / "nginx.conf"),
             "-e", str(self.dir / "error.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {self._proc.stderr.read().decode()[-2000:]}"  # type: ignore[union-attr]
                                   f"{self.error_log()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("nginx did not listen within 10 s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()  # our own nginx master (it stops its workers)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def error_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "error.log").read_text()
        return ""

    def _log(self) -> list[list[str]]:
        with contextlib.suppress(OSError):
            return [line.split() for line in (self.dir / "access.log").read_text().splitlines()]
        return []

    def origin_fetches(self) -> list[str]:
        """Keys the mirror fetched from the origin (one per request its fetch side served)."""
        return [f[2].lstrip("/") for f in self._log() if f[0] == str(self.fetch_port)]

    def answers(self) -> list[tuple[str, str, str]]:
        """(key, status, cache status) of every request replicas made to the mirror."""
        return [(f[2].lstrip("/"), f[3], f[4]) for f in self._log() if f[0] == str(self.port)]


def _ca_file() -> str:
    for path in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
                 "/etc/ssl/cert.pem"):
        if os.path.isfile(path):
            return path
    import certifi  # a dependency of requests / huggingface_hub

    return str(certifi.where())


class BadMirror(LoopServer):
    """A mirror that fails on purpose, on its own loopback port and thread.

    ``source(key)`` gives an object's true bytes (or None: 404). ``mode``: ``corrupt`` (the
    right length, the first byte flipped), ``hang`` (accepts, never answers), ``trickle``
    (``trickle_bytes_per_s``), ``ok`` (serves the true bytes)."""

    def __init__(self, source: Callable[[str], bytes | None], mode: str = "corrupt",
                 trickle_bytes_per_s: int = 64) -> None:
        super().__init__()
        self.source = source
        self.mode = mode
        self.trickle_bytes_per_s = trickle_bytes_per_s
        self.requests: list[dict[str, Any]] = []
        self.url = ""

    thread_name = "badmirror"
    shutdown_timeout_s = 0.2

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/{key:.*}", self._get)
        self.url = await self._serve(app)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        key = unquote(request.match_info["key"])
        self.requests.append({"key": key, "auth": "Authorization" in request.headers,
                              "cookie": "Cookie" in request.headers,
                              "range": request.headers.get("Range")})
        if self.mode == "hang":
            await asyncio.sleep(3600)
        data = self.source(key)
        if data is None:
            raise web.HTTPNotFound()
        start, end = _range(request.headers.get("Range"), len(data))
        body = data[start:end]
        if self.mode == "corrupt" and body:
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        resp = web.StreamResponse(status=206)
        resp.content_length = len(body)
        resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        await resp.prepare(request)
        if self.mode == "trickle":
            for i in range(len(body)):
                await resp.write(body[i:i + 1])
                await asyncio.sleep(1 / self.trickle_bytes_per_s)
        else:
            await resp.write(body)
        return resp


def _range(value: str | None, size: int) -> tuple[int, int]:
    if not value:
        return 0, size
    first, _, last = value.removeprefix("bytes=").partition("-")
    return int(first), min(size, int(last) + 1) if last else size


def dead_mirror_url() -> str:
    """A loopback URL nothing listens on (connections are refused)."""
    return f"http://127.0.0.1:{_free_port()}"

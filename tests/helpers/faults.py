"""Helpers of the fault matrix (and of the red-team and store tests that reuse them): a
misbehaving HTTP server on loopback, planted secrets, checks that a secret appears nowhere, the
CLI run in this process, and the rewrites a hostile publisher makes to a bucket.

``Hostile`` is a real aiohttp server on 127.0.0.1 (its own thread and loop). A test installs
handlers per route (``hostile.on("GET", "/path", handler)``); every request is logged in
``hostile.log``. Nothing here sends traffic to a non-loopback address: redirects to private
or link-local addresses must be refused before any connection, which is what the tests check.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.helpers.loopserver import LoopServer
from tests.helpers.publishing import reindex
from vllm_deltasync.format.manifest import dump_document, load_document, manifest_identity

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PLANTED = ("AKIAPLANTEDKEY0001", "planted-secret-0001", "planted-session-token-0001",
           "hf_planted_token_0001")
"""Strings that must never appear in any output, log, error or metric."""


class Hostile(LoopServer):
    """A small aiohttp server on loopback whose routes misbehave on purpose."""

    thread_name = "hostile-http"

    def __init__(self) -> None:
        super().__init__()
        self.handlers: dict[tuple[str, str], Handler] = {}
        self.log: list[tuple[str, str]] = []
        self.url = ""

    def on(self, method: str, path: str, handler: Handler) -> None:
        self.handlers[(method, path)] = handler

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        self.log.append((request.method, request.path_qs))
        handler = self.handlers.get((request.method, request.path))
        if handler is None and request.method == "HEAD":
            handler = self.handlers.get(("GET", request.path))
        if handler is None:
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})
        return await handler(request)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self.url = await self._serve(app, access_log=None)


class LookupLog:
    """Records every host name the process looks up (the real resolver still answers): what
    reaches ``socket.getaddrinfo``, under asyncio, aiohttp, urllib and botocore alike."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hosts: list[str] = []
        real = socket.getaddrinfo

        def lookup(host: Any, *args: Any, **kwargs: Any) -> Any:
            self.hosts.append(str(host))
            return real(host, *args, **kwargs)

        monkeypatch.setattr(socket, "getaddrinfo", lookup)


def assert_no_secret(*texts: Any) -> None:
    """None of :data:`PLANTED` (nor the query of a signed URL) in any of ``texts``."""
    for text in texts:
        shown = text if isinstance(text, str) else json.dumps(text, default=str)
        for secret in PLANTED:
            assert secret not in shown, f"secret {secret!r} leaked in: {shown[:500]}"


def manifest_doc(root: Path, step: int) -> dict[str, Any]:
    """The manifest's document, a version 3 tensor table expanded (``write_doc`` deflates it again)."""
    return load_document((root / "manifests" / f"{step:012d}.json").read_bytes())  # type: ignore[no-any-return]


def write_doc(root: Path, step: int, doc: dict[str, Any] | bytes) -> None:
    """Rewrite step ``step``'s manifest as a hostile publisher would: the deltas computed
    from it are re-linked (their ``base_id`` names the new bytes, and so on down the chain),
    so the defect under test is what the reader must find, not the rewritten identity."""
    path = root / "manifests" / f"{step:012d}.json"
    data = doc if isinstance(doc, bytes) else dump_document(doc)
    old = manifest_identity(path.read_bytes()) if path.exists() else None
    path.write_bytes(data)
    if old is None:
        return
    for later in sorted((root / "manifests").glob("*.json")):
        try:
            other = load_document(later.read_bytes())
        except (ValueError, RecursionError):  # garbage planted by the test itself
            continue
        if isinstance(other, dict) and other.get("base_id") == old:
            other["base_id"] = manifest_identity(data)
            write_doc(root, int(later.stem), other)


def root_of(url: str) -> Path:
    return Path(url[len("file://"):])


def rewrite_role(root: Path, doc: dict[str, Any], tensor: dict[str, Any], chunk: dict[str, Any],
                 role: str, data: bytes) -> None:
    """What a hostile (or buggy) publisher can do: give one role of a v2 chunk new bytes,
    appended to its data file, with every digest, size and index made consistent again, so
    only the decoder's own checks stand between the bytes and the weights."""
    import hashlib

    entry = doc["files"][chunk["file"]]
    path = root / entry["path"]
    body = path.read_bytes()
    chunk["roles"][role]["offset"], chunk["roles"][role]["length"] = len(body), len(data)
    body += data
    path.write_bytes(body)
    entry["size"], entry["sha256"] = len(body), hashlib.sha256(body).hexdigest()
    digest = hashlib.sha256()
    for name in sorted(chunk["roles"]):
        r = chunk["roles"][name]
        digest.update(body[r["offset"]: r["offset"] + r["length"]])
    chunk["sha256"] = digest.hexdigest()
    doc["totals"]["bytes"] = sum(f["size"] for f in doc["files"])
    reindex(doc)


def sparse_chunk(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (tensor, chunk) of a delta with the most changed elements in one chunk."""
    return max(((t, c) for t in doc["tensors"] for c in t["chunks"]), key=lambda tc: tc[1]["count"])


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the CLI in this process: (exit status, stdout, stderr)."""
    from vllm_deltasync.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(rc: int, err: str) -> None:
    """Nonzero exit, exactly one line on stderr, no traceback."""
    assert rc != 0
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err

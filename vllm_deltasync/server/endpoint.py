"""The engine core's HTTP endpoint: ``GET /metrics`` (Prometheus text) and ``GET /synced``
(readiness JSON, :meth:`~vllm_deltasync.server.metrics.SyncMetrics.synced`; ``?model=<name>``:
one followed target's, a LoRA adapter's or the drafter's), on the port of ``metrics_port``,
served from a daemon thread of the engine-core process."""

from __future__ import annotations

import json
import threading
import urllib.parse
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from vllm_deltasync.errors import ConfigError

if TYPE_CHECKING:
    from vllm_deltasync.server.metrics import SyncMetrics


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """No access log: a scrape every few seconds would flood the server's log."""


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class MetricsServer:
    """``GET /metrics`` (Prometheus text) and ``GET /synced`` (readiness JSON) on a daemon thread.

    ``port=0`` binds a free port (see :attr:`port`); callers map the config's 0 = off themselves
    (:meth:`SyncMetrics.start_server` does).
    """

    def __init__(self, metrics: SyncMetrics, *, port: int, addr: str = "0.0.0.0") -> None:
        if not 0 <= port < 65536:
            raise ConfigError(f"metrics port {port} is out of range: use 1-65535, or 0 for off")
        self.metrics = metrics
        self._prom = make_wsgi_app(metrics.registry)
        try:
            self._server = make_server(addr, port, self._app, _ThreadingServer, _QuietHandler)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {addr}:{port} ({exc}): choose another metrics_port"
            ) from exc
        self.port: int = self._server.server_port
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="deltasync-metrics", daemon=True
        )
        self._thread.start()

    def _app(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "/")
        if path != "/synced":
            return self._prom(environ, start_response)
        query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))
        try:
            limit = int(query.get("max_steps_behind", ["0"])[0])
        except ValueError:
            start_response("400 Bad Request", [("Content-Type", "text/plain")])
            return [b"max_steps_behind must be an integer\n"]
        model = query.get("model", [""])[0]
        if model:
            found = self.metrics.synced_target(model, limit)
            if found is None:
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"this server follows no target of that name\n"]
            ok, body = found
        else:
            ok, body = self.metrics.synced(limit)
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json")])
        return [json.dumps(body).encode()]

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


__all__ = ["MetricsServer"]

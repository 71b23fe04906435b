"""The tests' own HTTP servers (the local Hub bucket server, mirrors and routes that fail on
purpose) run aiohttp applications on loopback from an event loop on a thread of their own:
:class:`LoopServer` is that lifecycle, once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, Self, TypeVar

from aiohttp import web

T = TypeVar("T")


class LoopServer:
    """A context manager: entering starts the loop's thread and runs :meth:`_start` on it (which
    serves its applications with :meth:`_serve`); leaving runs :meth:`_stop`, ends the loop and
    joins the thread. Other threads reach the loop with :meth:`_call`."""

    thread_name = "loop-server"
    shutdown_timeout_s = 0.5
    """How long a stopping runner waits for open requests (a hanging handler is cancelled)."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=self.thread_name)

    def __enter__(self) -> Self:
        self._thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
        """Run ``coro`` on the server's loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _start(self) -> None:
        raise NotImplementedError

    async def _serve(self, app: web.Application, host: str = "127.0.0.1", **runner: Any) -> str:
        """Serve ``app`` on a free port of ``host``; its base URL."""
        run = web.AppRunner(app, shutdown_timeout=self.shutdown_timeout_s, handle_signals=False,
                            **runner)
        await run.setup()
        await web.TCPSite(run, host, 0).start()
        self._runners.append(run)
        return f"http://{host}:{run.addresses[0][1]}"

    async def _stop(self) -> None:
        """Cancel what still runs on the loop (hanging handlers, open event feeds), then stop
        the applications."""
        current = asyncio.current_task()
        leftovers = [t for t in asyncio.all_tasks() if t is not current]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
        for run in self._runners:
            await run.cleanup()

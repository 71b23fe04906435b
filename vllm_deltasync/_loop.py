"""An asyncio event loop on a daemon thread, and one bridge for synchronous callers.

The stores are async; the publisher and the CLI are synchronous. They reach the loop through
:meth:`BackgroundLoop.run` with a timeout (the fsspec ``asyn.py`` pattern: ``get_loop()`` +
``sync()``). :func:`default_loop` is one process-wide loop started on first use.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """An event loop running on its own daemon thread, started on first use.

    Once closed (:meth:`close`) it stays closed: using it again raises instead of starting a new
    thread behind the owner's back (a closed poller must not come back to life).
    ``thread_init`` runs first on the loop's thread (the poller places it on its cores)."""

    def __init__(self, name: str = "vllm-deltasync-io",
                 thread_init: Callable[[], None] | None = None) -> None:
        self._name = name
        self._thread_init = thread_init
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (started now if needed); RuntimeError once closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"background loop {self._name!r} is closed")
            if self._loop is None:
                self._start()
            assert self._loop is not None
            return self._loop

    def running_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop if it is running now, else None (never starts one)."""
        with self._lock:
            loop = self._loop
            return None if self._closed or loop is None or loop.is_closed() else loop

    def _start(self) -> None:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            if self._thread_init is not None:
                self._thread_init()
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        thread = threading.Thread(target=main, name=self._name, daemon=True)
        thread.start()
        ready.wait()
        self._loop, self._thread = loop, thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (``TimeoutError`` after ``timeout`` s)."""
        if self._thread is not None and threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("BackgroundLoop.run called from its own loop thread (deadlock)")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"operation did not finish within {timeout} s") from None

    def close(self) -> None:
        """Stop the loop and join its thread for good. Pending tasks are cancelled."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
            self._closed = True
        if loop is None or thread is None:
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


_DEFAULT: BackgroundLoop | None = None
_DEFAULT_LOCK = threading.Lock()


def default_loop() -> BackgroundLoop:
    """The process-wide background loop."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = BackgroundLoop()
        return _DEFAULT


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the process-wide loop from synchronous code."""
    return default_loop().run(coro, timeout)

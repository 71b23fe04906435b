"""Writes of the hf:// store: the Xet upload (or the ``uploader`` seam) and the batch API.

Writes go through ``huggingface_hub.batch_bucket_files`` (uploads need ``hf_xet``). The Xet
upload protocol cannot run offline, so the upload call is the one seam: ``uploader=`` (an async
callable taking ``[(bucket_path, bytes), ...]``) replaces it. Deletes use the same batch API
(no Xet needed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from vllm_deltasync.errors import StoreError
from vllm_deltasync.stores._hfhttp import hub_error
from vllm_deltasync.stores.base import StoreStats

Uploader = Callable[[list[tuple[str, bytes]]], Awaitable[None]]
"""Uploads ``[(path in bucket, bytes), ...]``; the seam that replaces the Xet upload in tests."""


class BatchWriter:
    """Uploads and deletes full bucket paths of one bucket; counts them in ``stats``."""

    def __init__(self, url: str, endpoint: str, bucket_id: str, token: Callable[[], str | None],
                 uploader: Uploader | None, stats: StoreStats) -> None:
        self.url, self.endpoint, self.bucket_id = url, endpoint, bucket_id
        self._token = token  # a closure: the secret is never an attribute (repr, vars)
        self.uploader = uploader
        self.stats = stats

    async def upload(self, items: list[tuple[str, bytes]]) -> None:
        try:
            if self.uploader is not None:
                await self.uploader(items)
            else:
                await asyncio.to_thread(self._hub_batch, add=items)
        except StoreError:
            self.stats.count("write", "error")
            raise
        self.stats.count("write", "ok", len(items))
        self.stats.bytes_written += sum(len(d) for _, d in items)

    async def delete(self, paths: Sequence[str]) -> None:
        if paths:
            await asyncio.to_thread(self._hub_batch, delete=list(paths))
            self.stats.count("delete", "ok", len(paths))

    def _hub_batch(self, **ops: Any) -> None:
        """``huggingface_hub.HfApi.batch_bucket_files`` against this endpoint (in a thread)."""
        from huggingface_hub import HfApi

        api = HfApi(endpoint=self.endpoint, token=self._token() or False)
        try:
            api.batch_bucket_files(self.bucket_id, **ops)
        except Exception as exc:  # huggingface_hub / httpx errors, translated here
            raise hub_error(
                getattr(getattr(exc, "response", None), "status_code", 0),
                f"{self.url}: batch failed ({type(exc).__name__})",
            ) from exc


__all__ = ["BatchWriter", "Uploader"]

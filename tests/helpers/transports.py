"""What the tests need to reach the local bucket servers: moto's credentials, the test uploader
of hf:// (the Xet upload cannot run offline), and what a mirror of an hf:// prefix fetches from."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from vllm_deltasync.stores.hf import HfStore

S3_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing-secret-key"}


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


def hub_origin(hub: Any, store: HfStore) -> tuple[str, str]:
    """What a mirror of ``store`` (on the local Hub server) fetches from: the resolve base URL
    of its prefix and the ``Authorization`` the mirror sends there."""
    tail = f"{store.prefix}/" if store.prefix else ""
    return (f"{hub.endpoint}/buckets/{store.bucket_id}/resolve/{tail}",
            f"Bearer {hub.token}")

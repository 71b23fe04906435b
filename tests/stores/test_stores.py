"""file:// and memory:// stores: immutability, atomicity, listing, ranges."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_deltasync.errors import AlreadyExistsError, ConfigError, NotFoundError
from vllm_deltasync.stores import Store, open_store
from vllm_deltasync.stores.local import LocalStore
from vllm_deltasync.stores.memory import MemoryStore


@pytest.fixture(params=["file", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "file":
        yield open_store(f"file://{tmp_path}/b")
    else:
        yield open_store("memory://format-tests")
        MemoryStore.drop("format-tests")


def test_contract(store: Store) -> None:
    async def go() -> None:
        await store.write("manifests/000000000002.json", b"two")
        await store.write("data/x/00000.safetensors", b"0123456789")
        await store.write("manifests/000000000001.json", b"one")
        assert [o.path for o in await store.list("manifests/")] == [
            "manifests/000000000001.json", "manifests/000000000002.json"]
        assert [o.size for o in await store.list()] == [10, 3, 3]
        with pytest.raises(AlreadyExistsError):
            await store.write("manifests/000000000001.json", b"again")
        assert await store.read("manifests/000000000001.json") == b"one"
        await store.write("manifests/000000000001.json", b"uno", overwrite=True)
        assert await store.read("data/x/00000.safetensors", 2, 5) == b"234"
        assert await store.read("data/x/00000.safetensors", 7) == b"789"
        info = await store.stat("data/x/00000.safetensors")
        assert info is not None and info.size == 10
        assert await store.stat("nope") is None
        with pytest.raises(NotFoundError):
            await store.read("nope")
        await store.delete(["data/x/00000.safetensors", "never-was"])
        assert [o.path for o in await store.list("data/")] == []
        for bad in ("../escape", "/abs", "a//b"):
            with pytest.raises(ConfigError):
                await store.write(bad, b"")
        assert store.stats.bytes_written == 19

    asyncio.run(go())


def test_local_store_publishes_whole_files_only(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    asyncio.run(store.write("a/b.bin", b"x" * 1000))
    leftovers = [p.name for p in (tmp_path / "a").iterdir()]
    assert leftovers == ["b.bin"]
    (tmp_path / "a" / ".tmp-c.bin.123").write_bytes(b"half")  # a writer killed mid-file
    assert [o.path for o in asyncio.run(store.list())] == ["a/b.bin"]
    asyncio.run(store.delete(["a/b.bin", "a/.tmp-c.bin.123"]))
    assert not (tmp_path / "a").exists()


def test_urls() -> None:
    assert LocalStore.from_url("file:///tmp/x").root == Path("/tmp/x")
    assert open_store("/tmp/y").url == "file:///tmp/y"
    one, two = open_store("memory://shared"), open_store("memory://shared")
    asyncio.run(one.write("k", b"v"))
    assert asyncio.run(two.read("k")) == b"v"
    MemoryStore.drop("shared")
    with pytest.raises(ConfigError, match="unknown scheme"):
        open_store("ftp://x/y")

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


def test_local_write_after_stages_the_file_and_leaves_no_temp(tmp_path: Path) -> None:
    """file://: the bytes are written (fsync'ed) while ``ready`` runs; the name appears only
    after it, and a failed ``ready`` leaves no temporary file behind."""
    store = LocalStore(tmp_path)

    async def scenario() -> list[str]:
        ready = asyncio.Event()
        writing = asyncio.ensure_future(store.write_after("m/1.json", b"commit", ready.wait()))
        await asyncio.sleep(0.1)
        staged = sorted(p.name for p in (tmp_path / "m").iterdir())
        ready.set()
        await writing
        return staged

    staged = asyncio.run(scenario())
    assert len(staged) == 1 and staged[0].startswith(".tmp-1.json.")  # written, not published
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["1.json"]
    assert (tmp_path / "m" / "1.json").read_bytes() == b"commit"
    assert store.create_is_atomic

    async def failing() -> None:
        await asyncio.sleep(0.05)
        raise ValueError("data not written")

    with pytest.raises(ValueError, match="data not written"):
        asyncio.run(store.write_after("m/2.json", b"never", failing()))
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["1.json"]


def test_local_store_without_hard_links_is_not_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem without hard links: create-only falls back to a check and a rename, which
    two writers may race, and the store says so (a publisher then reads its commit back)."""
    store = LocalStore(tmp_path)

    def no_link(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("os.link", no_link)
    asyncio.run(store.write("a.bin", b"x"))
    assert (tmp_path / "a.bin").read_bytes() == b"x"
    assert not store.create_is_atomic


def test_urls() -> None:
    assert LocalStore.from_url("file:///tmp/x").root == Path("/tmp/x")
    assert open_store("/tmp/y").url == "file:///tmp/y"
    one, two = open_store("memory://shared"), open_store("memory://shared")
    asyncio.run(one.write("k", b"v"))
    assert asyncio.run(two.read("k")) == b"v"
    MemoryStore.drop("shared")
    with pytest.raises(ConfigError, match="unknown scheme"):
        open_store("ftp://x/y")

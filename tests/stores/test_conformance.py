"""The store contract of ``stores/base.py``, run on every scheme (file, memory, hf, s3).

Each scheme supplies only the ``store`` fixture (conftest.py): hf:// runs against the local Hub
bucket server, s3:// against moto's S3 server, both over HTTP on loopback.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from vllm_deltasync.errors import AlreadyExistsError, ConfigError, NotFoundError
from vllm_deltasync.stores import ObjectInfo, Store


class TestReadWrite:
    def test_round_trip_and_ranges(self, store: Store, run: Any) -> None:
        data = os.urandom(1000)
        run(store.write("data/a.bin", data))
        assert run(store.read("data/a.bin")) == data
        assert run(store.read("data/a.bin", 10, 20)) == data[10:20]
        assert run(store.read("data/a.bin", 990)) == data[990:]
        assert run(store.read("data/a.bin", 0, 1)) == data[:1]

    def test_memoryview_and_empty_objects(self, store: Store, run: Any) -> None:
        run(store.write("x/empty", b""))
        run(store.write("x/view", memoryview(b"abcdef")[1:4]))
        assert run(store.read("x/empty")) == b""
        assert run(store.read("x/view")) == b"bcd"

    def test_large_object_in_parts(self, store: Store, run: Any, large_size: int) -> None:
        data = os.urandom(large_size)
        run(store.write("data/big.bin", data))
        assert run(store.read("data/big.bin")) == data
        middle = (large_size // 3, large_size // 3 + 200_001)
        assert run(store.read("data/big.bin", *middle)) == data[middle[0] : middle[1]]
        assert run(store.read("data/big.bin", large_size - 7)) == data[-7:]

    def test_missing_object(self, store: Store, run: Any) -> None:
        with pytest.raises(NotFoundError):
            run(store.read("data/nope.bin"))
        assert run(store.stat("data/nope.bin")) is None

    def test_stat(self, store: Store, run: Any) -> None:
        run(store.write("manifests/000000000001.json", b"{}" * 21))
        info = run(store.stat("manifests/000000000001.json"))
        assert isinstance(info, ObjectInfo)
        assert (info.path, info.size) == ("manifests/000000000001.json", 42)


class TestImmutability:
    def test_write_refuses_overwrite(self, store: Store, run: Any) -> None:
        run(store.write("m/1.json", b"first"))
        with pytest.raises(AlreadyExistsError):
            run(store.write("m/1.json", b"second"))
        assert run(store.read("m/1.json")) == b"first"

    def test_overwrite_when_asked(self, store: Store, run: Any) -> None:
        run(store.write("m/1.json", b"first"))
        run(store.write("m/1.json", b"second!", overwrite=True))
        assert run(store.read("m/1.json")) == b"second!"

    def test_write_many(self, store: Store, run: Any) -> None:
        items = [(f"data/s-1/{i:05d}.safetensors", os.urandom(100 + i)) for i in range(5)]
        run(store.write_many(items))
        for path, data in items:
            assert run(store.read(path)) == data
        with pytest.raises(AlreadyExistsError):
            run(
                store.write_many([("data/s-1/00002.safetensors", b"again"), ("data/s-1/new", b"n")])
            )
        assert run(store.read("data/s-1/00002.safetensors")) == items[2][1]

    def test_write_after_waits_for_ready(self, store: Store, run: Any) -> None:
        async def scenario() -> tuple[bool, bool]:
            ready = asyncio.Event()
            writing = asyncio.ensure_future(store.write_after("manifests/7.json", b"commit", ready.wait()))
            await asyncio.sleep(0.05)  # the store may prepare the write meanwhile, not publish it
            visible_before = await store.stat("manifests/7.json") is not None
            ready.set()
            await writing
            return visible_before, await store.stat("manifests/7.json") is not None

        assert run(scenario()) == (False, True)
        assert run(store.read("manifests/7.json")) == b"commit"
        with pytest.raises(AlreadyExistsError):  # create-only, like write
            run(store.write_after("manifests/7.json", b"again", asyncio.sleep(0)))

    def test_write_after_writes_nothing_when_ready_fails(self, store: Store, run: Any) -> None:
        async def failing() -> None:
            await asyncio.sleep(0.02)
            raise NotFoundError("a data file was not written")

        with pytest.raises(NotFoundError, match="a data file was not written"):
            run(store.write_after("manifests/8.json", b"commit", failing()))
        assert run(store.stat("manifests/8.json")) is None
        assert [o.path for o in run(store.list("manifests/"))] == []

    @pytest.mark.parametrize("bad", ["../escape", "/abs", "a//b", "a/./b", ""])
    def test_bad_paths_are_refused(self, store: Store, run: Any, bad: str) -> None:
        with pytest.raises(ConfigError):
            run(store.write(bad, b"x"))


class TestListDelete:
    def test_list_is_recursive_sorted_and_filtered(self, store: Store, run: Any) -> None:
        paths = [
            "manifests/000000000010.json",
            "data/b/2",
            "data/a/1",
            "manifests/000000000002.json",
            "top",
        ]
        for path in paths:
            run(store.write(path, path.encode()))
        listed = run(store.list())
        assert [o.path for o in listed] == sorted(paths)
        assert {o.path: o.size for o in listed} == {p: len(p) for p in paths}
        assert [o.path for o in run(store.list("manifests/"))] == [
            "manifests/000000000002.json",
            "manifests/000000000010.json",
        ]
        assert [o.path for o in run(store.list("data/a"))] == ["data/a/1"]
        assert run(store.list("absent/")) == []

    def test_list_pages(self, store: Store, run: Any) -> None:
        paths = [f"data/p/{i:03d}" for i in range(11)]  # the Hub server pages by 3
        run(store.write_many([(p, b"x") for p in paths]))
        assert [o.path for o in run(store.list("data/"))] == paths

    def test_delete_ignores_missing(self, store: Store, run: Any) -> None:
        run(store.write_many([("d/1", b"1"), ("d/2", b"2")]))
        run(store.delete(["d/1", "d/missing"]))
        assert [o.path for o in run(store.list("d/"))] == ["d/2"]
        assert run(store.stat("d/1")) is None
        run(store.delete([]))


class TestIdentity:
    def test_url_and_repr(self, store: Store) -> None:
        assert store.url.startswith(f"{store.scheme}://")
        assert store.url in repr(store)

    def test_stats_count_traffic(self, store: Store, run: Any) -> None:
        run(store.write("s/1", b"12345"))
        run(store.read("s/1"))
        assert store.stats.bytes_read >= 5
        assert sum(store.stats.requests.values()) >= 2

"""Fixtures of the store tests: one store per scheme, for the conformance suite.

The servers behind the network schemes (the local Hub bucket server, moto's S3 server) and the
per-test event loop ``run`` are in tests/conftest.py, shared with the engine tests. The
conformance suite asks for ``store``, parametrized over the four schemes; transport tests ask
for ``hub`` / ``hf_store`` or ``s3_endpoint`` / ``s3_store``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_deltasync.stores import Store, open_store
from vllm_deltasync.stores.memory import MemoryStore
from vllm_deltasync.stores.s3 import S3Store

SCHEMES = ["file", "memory", "hf", "s3"]


# -- one store per scheme, for the conformance suite -------------------------------------------


@pytest.fixture(params=SCHEMES)
def store(request: pytest.FixtureRequest, tmp_path: Path, run: Any) -> Iterator[Store]:
    """The store under test; each scheme supplies only how to open one."""
    scheme = request.param
    if scheme == "file":
        made: Store = open_store(f"file://{tmp_path}/bucket")
    elif scheme == "memory":
        made = open_store(f"memory://conformance-{uuid.uuid4().hex[:8]}")
    elif scheme == "hf":
        made = request.getfixturevalue("make_hf_store")()
    else:
        made = request.getfixturevalue("make_s3_store")()
    yield made
    if scheme in ("file", "memory"):
        run(made.close())
    if isinstance(made, MemoryStore):
        MemoryStore.drop(made.name)


@pytest.fixture
def large_size(store: Store) -> int:
    """An object size that spans several parallel parts on the network stores."""
    return 11 << 20 if isinstance(store, S3Store) else (5 << 16) + 123

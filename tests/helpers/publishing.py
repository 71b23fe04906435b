"""A stand-in trainer and its bucket: the publishing helpers of the format, trainer, CLI and
fault tests.

``Trainer`` stands in for an optimizer: fp32 master weights shaped like a small transformer,
updated each step by an Adam-like step (``lr * sign``); at the default lr about 1% of the
bf16 elements change per step, as at RL learning rates. Its ``bf16()`` is the ground truth a bucket must reproduce.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_deltasync.errors import TransientStoreError
from vllm_deltasync.format.manifest import merge_ranges
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.stores.local import LocalStore

REPO = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).with_name("vllm-deltasync")

SHAPES: dict[str, tuple[int, ...]] = {
    "model.embed_tokens.weight": (96, 32),
    "model.layers.0.self_attn.q_proj.weight": (32, 32),
    "model.layers.0.self_attn.k_proj.weight": (16, 32),
    "model.layers.0.mlp.down_proj.weight": (32, 64),
    "model.layers.0.input_layernorm.weight": (32,),
    "lm_head.weight": (96, 32),
}


class Trainer:
    """fp32 master weights with Adam-like updates; ``bf16()`` is what must be published."""

    def __init__(self, seed: int = 0, lr: float = 3e-7, shapes: dict[str, tuple[int, ...]] = SHAPES) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.lr = lr
        self.weights = {
            name: (1.0 + 0.1 * torch.randn(shape, generator=self.gen)) if len(shape) == 1
            else 0.02 * torch.randn(shape, generator=self.gen)
            for name, shape in shapes.items()
        }

    def step(self) -> None:
        for w in self.weights.values():
            w.sub_(self.lr * torch.sign(torch.randn(w.shape, generator=self.gen)))

    def bf16(self) -> dict[str, torch.Tensor]:
        return {name: w.to(torch.bfloat16) for name, w in self.weights.items()}


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, shapes and bf16 bit patterns."""
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))
        for k in a
    )


def read_full(url: str, step: int | None = None) -> dict[str, torch.Tensor]:
    async def go() -> dict[str, torch.Tensor]:
        async with BucketReader.open(url) as reader:
            return await reader.read_full(step)

    return asyncio.run(go())


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the installed ``vllm-deltasync`` console script."""
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


class GatedStore(LocalStore):
    """A local store whose writes can be held or made to fail (fault injection for tests).

    ``gated://NAME/path``: ``GATES[NAME]`` (a threading.Event) must be set before a write
    proceeds; ``FAIL_MANIFEST[NAME]`` = a step whose manifest write fails once. A test module
    that uses it registers the scheme: ``register_store("gated", *GATED)``.
    """

    scheme = "gated"
    GATES: dict[str, threading.Event] = {}
    FAIL_MANIFEST: dict[str, int] = {}

    def __init__(self, name: str, root: str) -> None:
        super().__init__(root, fsync=False)
        self.name = name

    @classmethod
    def from_url(cls, url: str, **options: Any) -> GatedStore:
        name, root = url.split("://", 1)[1].split("/", 1)
        return cls(name, "/" + root)

    async def write(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> None:
        gate = self.GATES.get(self.name)
        if gate is not None:
            await asyncio.to_thread(gate.wait)
        fail = self.FAIL_MANIFEST.get(self.name)
        if fail is not None and path == f"manifests/{fail:012d}.json":
            del self.FAIL_MANIFEST[self.name]
            raise TransientStoreError(f"{path}: injected failure")
        await super().write(path, data, overwrite=overwrite)


GATED = (__name__, "GatedStore")
"""Where the store registry finds :class:`GatedStore` (``register_store("gated", *GATED)``)."""


def data_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "data").iterdir()) if (root / "data").exists() else []


def manifest_steps(root: Path) -> list[int]:
    folder = root / "manifests"
    return sorted(int(p.stem) for p in folder.glob("*.json")) if folder.exists() else []


def publish_run(url: str, steps: Sequence[int], trainer: Trainer, **options: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Publish ``steps`` of ``trainer``; returns the bf16 truth of each step."""
    from vllm_deltasync import DeltaPublisher

    truth = {}
    with DeltaPublisher(url, **options) as pub:
        for step in steps:
            trainer.step()
            pub.publish(step, trainer.weights)
            truth[step] = trainer.bf16()
    return truth


def reindex(doc: dict[str, Any]) -> None:
    """Keep a hostile v2 manifest self-consistent (file index = its chunks' byte ranges)."""
    if doc["schema_version"] < 2:
        return
    found: list[dict[str, list[tuple[int, int]]]] = [{} for _ in doc["files"]]
    for t in doc["tensors"]:
        for c in t["chunks"]:
            for r in c["roles"].values():
                found[c["file"]].setdefault(t["name"], []).append((r["offset"], r["length"]))
    for f, ranges in zip(doc["files"], found, strict=True):
        f["index"] = {n: [list(r) for r in merge_ranges(rs)] for n, rs in ranges.items()}

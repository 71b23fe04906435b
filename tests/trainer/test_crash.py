"""A publisher killed (SIGKILL) after its data files but before its manifest."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.publishing import (
    REPO,
    Trainer,
    bits_equal,
    data_dirs,
    manifest_steps,
    read_full,
    run_cli,
)
from vllm_deltasync import BucketReader, DeltaPublisher

CHILD = r"""
import asyncio, sys, types
import torch
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.stores import register_store
from vllm_deltasync.stores.local import LocalStore

class HangAtManifest(LocalStore):
    @classmethod
    def from_url(cls, url, **options):
        return cls(url.split("://", 1)[1])

    async def write(self, path, data, *, overwrite=False):
        if path == "manifests/000000000003.json":
            print("HANGING", flush=True)
            await asyncio.sleep(3600)
        await super().write(path, data, overwrite=overwrite)

module = types.ModuleType("hang_store")
module.HangAtManifest = HangAtManifest
sys.modules["hang_store"] = module
register_store("hang", "hang_store", "HangAtManifest")
gen = torch.Generator().manual_seed(1)
w = {"a": torch.randn(64, 64, generator=gen), "b": torch.randn(300, generator=gen)}
pub = DeltaPublisher("hang://" + sys.argv[1], anchor_every=10, max_file_bytes=1024,
                     writer_token="0123abcd0123abcd")
for step in range(5):
    w["a"].add_(1e-3 * torch.randn(64, 64, generator=gen))
    w["b"].add_(1e-3 * torch.randn(300, generator=gen))
    pub.publish(step, w)
pub.flush()
"""


def test_killed_between_data_and_manifest_leaves_no_step(tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "HANGING", child.stderr.read() if child.stderr else ""
        attempt = [d for d in data_dirs(root) if d.startswith("000000000003-")]
        assert len(attempt) == 1 and len(list((root / "data" / attempt[0]).iterdir())) > 1
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    assert manifest_steps(root) == [0, 1, 2]  # step 3's data exists but is invisible

    async def latest() -> int | None:
        async with BucketReader.open(f"file://{root}") as reader:
            return await reader.latest_step()

    assert asyncio.run(latest()) == 2
    verify = run_cli("verify", f"file://{root}")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    read_full(f"file://{root}", 2)  # the committed chain is intact

    trainer = Trainer(shapes={"a": (64, 64), "b": (300,)})
    started = time.monotonic()
    # the restarted job resumes its writer token, so its retention may clean the dead attempt
    # (under a new token the orphan is another writer's and is left alone: test_writer.py)
    with DeltaPublisher(f"file://{root}", anchor_every=10, max_file_bytes=4096,
                        writer_token="0123abcd0123abcd") as pub:
        assert pub.last_step == 2
        for step in (3, 4, 5):  # the killed step number is free again, under a new name
            trainer.step()
            pub.publish(step, trainer.weights)
    assert time.monotonic() - started < 30
    assert manifest_steps(root) == [0, 1, 2, 3, 4, 5]
    assert bits_equal(read_full(f"file://{root}", 5), trainer.bf16())
    assert attempt[0] not in data_dirs(root)  # the orphan went with the next anchor (step 3)

"""Multi-rank trainers: ``dist_worker.py`` (this folder) under ``torchrun`` (gloo, CPU), in a
child process group with a timeout (the sharded trainer's tests and the engine that follows a
sharded trainer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "dist_worker.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def torchrun(nproc: int, *args: str, timeout: float = 180) -> None:
    """Run the worker under torchrun; on a timeout the whole process group is killed."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), str(WORKER), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
        start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun ran past {timeout}s:\n{output[-6000:]}")
    assert proc.returncode == 0, output[-8000:]

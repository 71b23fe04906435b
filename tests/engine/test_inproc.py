"""An in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) follows a bucket by itself.

vLLM then builds the ``EngineCore`` in the caller's process (``InprocClient``) and steps it from
the caller's thread: no busy loop, no input queue. The extension starts its coordinator once
the engine core is built and ticks before the client's steps and ``collective_rpc`` calls (at
most once per poll interval). The trainer publishes 3 real AdamW bf16 steps; after each the
live weights equal the trainer's bit for bit, and at the last step greedy tokens and prompt
logprobs equal a fresh stock engine's on that step's checkpoint (prompts the engine had served
at every earlier step: each step's first serving reads none of the earlier steps' blocks, which
are salted by other weights, and the second hits the step's own).

The engine runs in a fresh process (``tests/engine/inproc_follow.py``): an in-process engine
changes the process that holds it for good (frozen vLLM environment variables, threads bound
to cores), which must not leak into the tests after this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.engine_hooks import REPO
from tests.helpers.engines import FreshOutputs, requires_vllm


@requires_vllm
@pytest.mark.engine
def test_inprocess_engine_follows_bucket(tmp_path: Path, fresh_outputs: FreshOutputs) -> None:
    out = tmp_path / "out.json"
    log = tmp_path / "child.log"
    with log.open("wb") as sink:
        proc = subprocess.run([sys.executable, "-m", "tests.engine.inproc_follow",
                               str(tmp_path), str(out)], cwd=REPO, stdout=sink,
                              stderr=subprocess.STDOUT, timeout=400, env=dict(os.environ))
    assert proc.returncode == 0, log.read_text(errors="replace")[-4000:]
    got = json.loads(out.read_text())
    steps = len(got["digests_equal"])
    assert got["core_class"] == "EngineCore"  # in process: no busy loop
    assert got["rank_pid"] == got["process"]  # the rank ran in the caller's process
    assert all(e is None for e in got["errors"]), got["errors"]
    assert all(got["digests_equal"].values()), got["digests_equal"]
    status = got["status"]
    assert status["active"] and status["weight_version"] == str(steps)
    assert status["switches"] == list(range(steps + 1))
    last, first = got["outputs"][str(steps)], got["outputs"]["0"]
    assert all(o["versions"][-1] == str(steps) for o in last)
    assert last != first
    [reference] = fresh_outputs(1, got["prompts"], [Path(got["ckpt"])])
    reference = json.loads(json.dumps(reference))  # the child's outputs went through JSON too
    for i, (mine, ref) in enumerate(zip(last, reference, strict=True)):
        assert mine["tokens"] == ref["tokens"], f"prompt {i}: greedy tokens differ"
        assert mine["prompt_logprobs"] == ref["prompt_logprobs"], f"prompt {i}: prompt logprobs differ"
        assert mine["logprobs"] == ref["logprobs"], f"prompt {i}: token logprobs differ"
    # each step's first serving reads no block of the step before (the caller's thread salts
    # each request as it adds it); the same prompts again hit the step's own blocks
    assert all(c == 0 for step, hits in got["cached"].items() if step != "0" for c in hits)
    assert all(c > 0 for c in got["cached_again"]), got["cached_again"]

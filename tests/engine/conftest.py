"""Fixtures of the engine tests: ``fresh_outputs``, what a fresh stock engine generates from a
checkpoint.

Engine tests start vLLM (the CPU build here) in this process with the extension configured the
way a user would: ``worker_extension_cls`` plus ``VLLM_DELTASYNC_*`` environment variables.
Nothing calls ``deltasync_start``: the plugin starts everything by itself. The bucket is a
``file://`` directory, or served over HTTP on loopback by the local Hub bucket server (hf://)
or moto (s3://) of tests/conftest.py, which the engine's processes find only through the
standard environment (``HF_ENDPOINT``/``HF_TOKEN``, ``AWS_*``). What the tests share (engines,
buckets, API servers, LoRA adapters) is in tests/helpers/engines.py and
tests/helpers/lora_serving.py.

``fresh_outputs`` starts a new engine per checkpoint in a separate process
(tests/engine/fresh_engine.py) and remembers the answer for the session by the checkpoint's
bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.engines import REPO, FreshOutputs, checkpoint_key


@pytest.fixture(scope="session")
def fresh_outputs(tmp_path_factory: pytest.TempPathFactory) -> FreshOutputs:
    """``fresh_outputs(tp, prompts, checkpoints)``: per checkpoint, the greedy tokens and prompt
    logprobs of a fresh stock engine (same TP, no extension) started from that checkpoint.

    The engines run in a child process (tests/engine/fresh_engine.py), one new engine per
    checkpoint. Answers are remembered for the session by (TP, prompts, the checkpoint's bytes),
    so the same trainer run followed over another transport starts no engine twice.
    """
    cache: dict[str, list[dict[str, Any]]] = {}
    work = tmp_path_factory.mktemp("fresh-engines")

    def get(tp: int, prompts: list[str], checkpoints: list[Path]) -> list[list[dict[str, Any]]]:
        keys = [checkpoint_key(tp, prompts, c) for c in checkpoints]
        missing = [str(c) for c, k in zip(checkpoints, keys, strict=True) if k not in cache]
        if missing:
            n = len(list(work.iterdir()))
            spec, out, log = (work / f"{n}-{name}" for name in ("spec.json", "out.json", "log"))
            spec.write_text(json.dumps({"tp": tp, "prompts": prompts, "checkpoints": missing}))
            env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DELTASYNC_")}
            env["VLLM_CACHE_ROOT"] = str(work / "vllm-cache")
            with log.open("w") as sink:
                proc = subprocess.run(
                    [sys.executable, "-m", "tests.engine.fresh_engine", str(spec), str(out)],
                    cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                    timeout=120 + 90 * len(missing), check=False,
                )
            if proc.returncode:
                tail = log.read_text()[-3000:]
                raise AssertionError(f"fresh reference engines failed ({proc.returncode}):\n{tail}")
            answers = json.loads(out.read_text())
            for c, k in zip(checkpoints, keys, strict=True):
                if str(c) in answers:
                    cache[k] = answers[str(c)]
        return [cache[k] for k in keys]

    return get

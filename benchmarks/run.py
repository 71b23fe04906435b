"""The one entry point of the benchmark suite: runs what applies here, writes RESULTS.md.

    .venv/bin/python -m benchmarks.run [--quick] [--only codec,publisher] [--out benchmarks/RESULTS.md]
    .venv/bin/python -m benchmarks.run --only drafter --merge   # re-run one section in place

Each benchmark is a module ``benchmarks/bench_<name>.py`` with ``run(quick: bool) -> str``
(a Markdown section). A module that is missing, or whose dependencies are not installed on this
machine, is listed as skipped with the reason; one that fails is listed with its error, and the
others still run. The output names the date, the machine and the command, so one file holds
ratios measured side by side in one run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import re
import shlex
import sys
import time
import traceback
from pathlib import Path

import torch

BENCHMARKS = {
    "codec": "bytes per changed element and per step (v1, v2, v3; payload and all bytes), dense fallback, encode/decode vs memcpy, GPU apply",
    "publisher": "publish() and upload cost per training step, bytes per step; publish() and publish -> committed against the snapshot floor",
    "apply": "engine pause per delta vs full reload_weights; peak extra host memory vs delta size",
    "peers": "our scatter vs vLLM's load_checkpoint_weight_patches and reload_weights on one engine, at ~0.5% and ~3%, and the memory floor",
    "serving": "following throughput per in_flight mode (keep_kv, continue, drain) against stock vLLM, short and long sequences at batch 1 and 16, a ~1% step every 3 s; recompute tokens per switch, prefix-cache hit rate",
    "download": "download throughput vs plain parallel GET",
    "moe": "per-expert cost: shard map build with learned CPU MoE layouts, one step's apply, layout memory",
    "drafter": "speculative decoding: acceptance rate and decode throughput per training step, drafter following its bucket vs frozen, one run",
    "scale": "1T MoE scale model: one EP rank's real expert share over hf://, requests, bytes, publish/download/decode/apply, encode at 1/2 threads; EP rank 0's plan on full-size DeepSeek-V3 and 1T manifests (one core, median of 5); publish -> applied from measured rates and named assumptions, each halved and doubled",
    "fleet": "10, 100 and 1,000 simulated replicas (real discovery, download, node cache) on the local Hub server, with and without an nginx mirror and fetch jitter: origin requests per 5 min, origin bytes per step, mirror hit ratio, commit -> held p50/p99",
    "lora": "LoRA policies: changed bf16 elements per step of the merged weights vs the adapter's A and B (rank 8/64, lr 1e-6..1e-4), bytes per step merged vs adapter through real publishers; decode tokens/s stock vs following the merged bucket vs the adapter, an adapter step's pause vs vLLM's load_inplace",
    "gpu": "the GPU rows of every benchmark (publisher diff on the device, snapshot floor on the GPU, decode + apply of 7B shapes, engine apply pause, pytest -m gpu); 'not run' without CUDA",
}
DEFAULT_OUT = Path(__file__).with_name("RESULTS.md")


def machine() -> str:
    """One line describing this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines()
                   if x.startswith("MemTotal")) / 2**20
    except (OSError, StopIteration):
        mem = float("nan")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, {platform.system()} {platform.release()}")


def run_one(name: str, quick: bool) -> tuple[str, str]:
    """(status, Markdown body) of one benchmark; status is ok, skipped or failed."""
    try:
        module = importlib.import_module(f"benchmarks.bench_{name}")
    except ModuleNotFoundError as exc:
        missing = exc.name or str(exc)
        what = "not written yet" if missing == f"benchmarks.bench_{name}" else f"needs {missing!r}"
        return "skipped", f"skipped: {what} ({exc})"
    except ImportError as exc:
        return "skipped", f"skipped: a dependency is missing ({exc})"
    try:
        t0 = time.perf_counter()
        body = module.run(quick)
        return "ok", f"{body.rstrip()}\n\n_{name}: {time.perf_counter() - t0:.0f} s_"
    except Exception as exc:  # keep running the others; the file records the failure
        tb = traceback.format_exc(limit=4)
        return "failed", f"failed: {type(exc).__name__}: {exc}\n\n```\n{tb}```"


def render(results: dict[str, tuple[str, str]], argv: list[str], started: datetime.datetime,
           seconds: float) -> str:
    lines = [
        "# Benchmark results",
        "",
        f"- date: {started.strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {machine()}",
        f"- command: `{shlex.join(['python', '-m', 'benchmarks.run', *argv])}` ({seconds:.0f} s)",
        "- produced by `benchmarks/run.py` in one run; regenerate with the same command.",
        "",
        "| benchmark | status | measures |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {status} | {BENCHMARKS[n]} |" for n, (status, _) in results.items()]
    for name, (_, body) in results.items():
        lines += ["", f"## {name}", "", body]
    return "\n".join(lines) + "\n"


def merge(old: str, results: dict[str, tuple[str, str]], argv: list[str],
          started: datetime.datetime, seconds: float) -> str:
    """``old`` (a RESULTS.md) with the sections of ``results`` replaced or added, and a header
    line saying which sections came from this later run (so no ratio is read across runs)."""
    head, *parts = re.split(r"(?m)^## (?=\S+\n)", old)
    sections = {p.split("\n", 1)[0]: p.split("\n", 1)[1] for p in parts}
    sections = {k: v for k, v in sections.items() if k in BENCHMARKS}
    table = dict(re.findall(r"(?m)^\| (\w+) \| (\w+) \| ", head))
    for name, (status, body) in results.items():
        sections[name] = f"\n{body}\n"
        table[name] = status
    order = [n for n in BENCHMARKS if n in sections]
    intro = head.split("\n| benchmark | status |", 1)[0].rstrip("\n").split("\n")
    intro.append(f"- {', '.join(results)} re-run alone on {started.strftime('%Y-%m-%d %H:%M UTC')}: "
                 f"`{shlex.join(['python', '-m', 'benchmarks.run', *argv])}` ({seconds:.0f} s); "
                 "compare within a section, not across these runs.")
    lines = [*intro, "", "| benchmark | status | measures |", "|---|---|---|"]
    lines += [f"| {n} | {table.get(n, 'not run')} | {BENCHMARKS[n]} |" for n in order]
    out = "\n".join(lines) + "\n"
    for name in order:
        out += f"\n## {name}\n{sections[name].rstrip()}\n"
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description="Run every benchmark that applies here.")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and the headline rows only (< 5 min; make bench-quick): "
                             "check a machine before quoting its numbers")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--merge", action="store_true",
                        help="keep the other sections of --out, replace or add only these")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHMARKS)}")
    started, t0 = datetime.datetime.now(datetime.UTC), time.perf_counter()
    results = {}
    for name in names:
        print(f"[benchmarks] {name} ...", file=sys.stderr, flush=True)
        results[name] = run_one(name, args.quick)
        print(f"[benchmarks] {name}: {results[name][0]}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    if args.merge and args.out.exists():
        args.out.write_text(merge(args.out.read_text(), results, argv, started, seconds))
    else:
        args.out.write_text(render(results, argv, started, seconds))
    print(f"[benchmarks] wrote {args.out}", file=sys.stderr)
    return 0 if all(status != "failed" for status, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

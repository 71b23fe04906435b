"""The whole loop on one machine: a trainer publishes, a vLLM engine follows, by itself.

    make demo            # or: .venv/bin/python examples/demo.py [--steps 12] [--out demo-out]

* A **trainer process** builds a small Llama-shaped model locally, then runs real AdamW steps
  on its bf16 weights and publishes each step to a ``file://`` bucket with ``DeltaPublisher``
  (an anchor every 5 steps, sparse deltas in between).
* This process starts a **vLLM engine** (the CPU build here, the GPU build elsewhere) with
  nothing but ``worker_extension_cls="vllm_deltasync.DeltaSyncExtension"`` and
  ``VLLM_DELTASYNC_URL`` pointing at the bucket, and keeps generating rollouts. The engine
  notices each step, stages it on every rank and switches between two batches.

One line per switch: step, kind, bytes downloaded, share of elements changed, how many steps
behind the newest published step the engine was when it switched, the pause between batches,
and the weight version vLLM attached to the rollouts generated right after.

The console shows that table and warnings only. The full log (vLLM and vllm_deltasync at INFO,
from every process: this one, the engine core, the trainer) goes to ``<out>/demo.log``, whose
path is printed at the start and the end. It is set up through ``VLLM_LOGGING_CONFIG_PATH``,
which every process vLLM starts reads when it imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
import logging.config
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
         "intermediate_size": 704, "vocab_size": 2000}


def logging_config(log_path: Path) -> dict[str, Any]:
    """``dictConfig`` for every process: warnings on the console, everything at INFO in the file."""
    to_both = {"handlers": ["console", "file"], "level": "INFO", "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "console": {"format": "%(levelname)s [%(name)s] %(message)s"},
            "file": {"format": "%(asctime)s %(levelname)s %(processName)s pid=%(process)d "
                               "[%(name)s:%(lineno)d] %(message)s"},
        },
        "handlers": {
            "console": {"class": "logging.StreamHandler", "stream": "ext://sys.stdout",
                        "level": "WARNING", "formatter": "console"},
            "file": {"class": "logging.FileHandler", "filename": str(log_path), "mode": "a",
                     "encoding": "utf-8", "level": "INFO", "formatter": "file"},
        },
        "loggers": {
            "vllm": to_both,
            "vllm_deltasync": to_both,
            "py.warnings": {"handlers": ["file"], "level": "WARNING", "propagate": False},
        },
    }


def setup_logging(config_path: Path) -> None:
    """Apply the demo's logging config in this process (vLLM re-applies it when imported)."""
    logging.config.dictConfig(json.loads(config_path.read_text()))
    logging.captureWarnings(True)


def trainer(model_dir: str, url: str, steps: int, interval_s: float, lr: float,
            engine_ready: Any, log_config: str) -> None:
    """The trainer process: AdamW in bf16, one publish per optimizer step."""
    setup_logging(Path(log_config))
    import torch
    from toymodel import load_hf_model

    from vllm_deltasync import DeltaPublisher

    torch.set_num_threads(1)
    model = load_hf_model(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    with DeltaPublisher(url, anchor_every=5) as pub:
        pub.publish(0, model.named_parameters())
        engine_ready.wait(timeout=600)  # so each step shows up as its own switch
        for step in range(1, steps + 1):
            time.sleep(interval_s)
            ids = torch.randint(2, model.config.vocab_size, (4, 64), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            pub.publish(step, model.named_parameters())


def _print_switch(sw: dict[str, Any], behind: int, version: str) -> None:
    kind = sw["kinds"][-1]
    print(f"{sw['step']:>5} {kind:>7} {sw['downloaded_bytes'][0] / 1024:>10.1f} KiB "
          f"{sw['changed'] / sw['numel']:>9.2%} {behind:>7} {sw['pause_s'] * 1e3:>9.2f} ms "
          f"{version:>8}", flush=True)


def follow(model_dir: Path, url: str, steps: int, engine_ready: Any) -> None:
    """This process: a vLLM engine that follows the bucket while it generates."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), worker_extension_cls="vllm_deltasync.DeltaSyncExtension",
              enforce_eager=True, max_model_len=512, dtype="bfloat16")
    engine_ready.set()
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=0)
    prompts = ["the policy reward model step"] * 4
    print(f"{'step':>5} {'kind':>7} {'bytes':>14} {'changed':>9} {'behind':>7} "
          f"{'pause':>12} {'rollouts':>8}", flush=True)
    seen, deadline = 0, time.monotonic() + 120 + 10 * steps
    while seen <= steps and time.monotonic() < deadline:
        outs = llm.generate(prompts, params, use_tqdm=False)
        versions = {s.version for o in outs for s in (o.outputs[0].weight_versions or [])}
        status = llm.llm_engine.engine_core.call_utility("deltasync_engine_status")
        ranks = llm.collective_rpc("deltasync_status")
        for sw in status["switches"]:
            if sw["step"] >= seen:
                newest = max(r["newest_step"] or 0 for r in ranks)
                _print_switch(sw, max(newest - sw["step"], 0), ",".join(sorted(versions)))
                seen = sw["step"] + 1
        if status["last_error"]:
            print("error:", status["last_error"], flush=True)
    llm.llm_engine.engine_core.shutdown()
    print(f"followed {seen - 1} of {steps} steps", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval-s", type=float, default=1.5, help="seconds between steps")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--out", default=None, help="work directory (default: a temp dir)")
    args = parser.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="deltasync-demo-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "demo.log"
    log_path.write_text("")
    log_config = work / "logging.json"
    log_config.write_text(json.dumps(logging_config(log_path), indent=2))
    # Before vLLM is imported, here and in every process it starts: the console gets warnings,
    # the file everything (a custom config file is authoritative over VLLM_LOGGING_LEVEL, which
    # only applies if it is not read).
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(log_config)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TQDM_DISABLE", "1")
    setup_logging(log_config)
    print(f"full log (vLLM + vllm_deltasync, INFO): {log_path}", flush=True)
    from toymodel import build_model

    model_dir = build_model(work / "model", "llama", **MODEL)
    url = f"file://{work}/bucket"
    os.environ.update({
        "VLLM_DELTASYNC_URL": url,
        "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.25",
        "VLLM_DELTASYNC_METRICS_PORT": os.environ.get("VLLM_DELTASYNC_METRICS_PORT", "0"),
        "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
        "VLLM_RPC_BASE_PATH": tempfile.mkdtemp(prefix="vrpc"),
    })
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ctx = mp.get_context("spawn")
    engine_ready = ctx.Event()
    proc = ctx.Process(name="trainer", target=trainer,
                       args=(str(model_dir), url, args.steps, args.interval_s, args.lr,
                             engine_ready, str(log_config)))
    proc.start()
    try:
        follow(model_dir, url, args.steps, engine_ready)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.terminate()
        print(f"full log: {log_path}", flush=True)


if __name__ == "__main__":
    main()

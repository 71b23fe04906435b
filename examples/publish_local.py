"""Train a small Llama-shaped model with AdamW on bf16 weights at an RL-like learning rate,
publishing every optimizer step to a local (file://) bucket.

    .venv/bin/python examples/publish_local.py --out demo-out --steps 20
    .venv/bin/vllm-deltasync inspect demo-out/bucket

Each committed step prints its kind, changed elements, sparsity and bytes next to the size of
a full bf16 checkpoint. The model is built locally (random init like a real model, a
tokenizer trained on the spot); nothing is downloaded. Running it again continues the
bucket from its newest step.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch
from toymodel import build_model, load_hf_model

from vllm_deltasync import DeltaPublisher, Manifest


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo-out", help="folder for the model and the bucket")
    p.add_argument("--bucket", default=None, help="bucket URL (default: file://OUT/bucket)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--anchor-every", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2000)
    return p.parse_args()


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    model_dir = Path(args.out) / "model"
    if not (model_dir / "config.json").exists():
        build_model(model_dir, "llama", hidden_size=args.hidden, num_layers=args.layers,
                    num_heads=4, num_kv_heads=2, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                    vocab_size=args.vocab, seed=0)
    model = load_hf_model(model_dir, dtype=torch.bfloat16)
    model.train()
    return model


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    model = make_model(args)
    full_bytes = sum(p.numel() * 2 for p in model.parameters())
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"full bf16 checkpoint {full_bytes / 2**20:.2f} MiB")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    url = args.bucket or f"file://{(Path(args.out) / 'bucket').resolve()}"
    lock = threading.Lock()

    def report(m: Manifest) -> None:  # called on the publisher's upload thread
        with lock:
            print(f"step {m.step:4d} {m.kind:<6} changed {m.totals.changed:9d}  sparsity "
                  f"{m.sparsity * 100:7.3f}%  bytes {m.totals.bytes:10d}  "
                  f"({m.totals.bytes / full_bytes * 100:6.2f}% of full)", flush=True)

    opt_s = 0.0
    with DeltaPublisher(url, anchor_every=args.anchor_every, on_commit=report) as pub:
        first = 0 if pub.last_step is None else pub.last_step + 1
        for step in range(first, first + args.steps):
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            started = time.perf_counter()
            optimizer.step()
            opt_s += time.perf_counter() - started
            optimizer.zero_grad(set_to_none=True)
            pub.publish(step, model.named_parameters())
        pub.flush()
        stats = pub.stats
    print(f"published steps {first}..{first + args.steps - 1} to {url}: {stats.steps} steps "
          f"({stats.anchors} anchors), {stats.bytes_written / 2**20:.2f} MiB written vs "
          f"{stats.steps * full_bytes / 2**20:.2f} MiB of full checkpoints")
    print(f"per step: optimizer {opt_s / args.steps * 1e3:.1f} ms, publish() on the training "
          f"thread {stats.diff_s / args.steps * 1e3:.1f} ms, background upload "
          f"{stats.upload_s / max(1, stats.steps) * 1e3:.1f} ms")
    print(f"next: vllm-deltasync inspect {url}")


if __name__ == "__main__":
    main()

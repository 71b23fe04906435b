"""Sharded publisher benchmark: FSDP2 on CPU (gloo), every rank publishes its own shards.

A Llama-shaped model (checkpoint names of ``LlamaForCausalLM``) is built on the meta device,
sharded with ``fully_shard`` and only then given storage, each rank initialising its own shards,
so no rank ever holds the full model. AdamW at lr 3e-6 on bf16 weights (as
``bench_publisher.py``). Per rank it reports:

* ``optimizer.step`` and ``publish()`` time on the training thread (median over the steps);
* the background upload time per step (encode + write + part record; rank 0 also collects the
  parts and commits);
* the publisher's extra peak RSS: the process's peak (VmHWM) after the publishing steps minus
  its peak after the same number of training steps without publishing, next to the size of the
  rank's bf16 shard copy.

    .venv/bin/python benchmarks/bench_sharded.py [--quick] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = {"quick": dict(vocab=8192, h=256, i=704, layers=4, steps=6),
         "full": dict(vocab=16384, h=512, i=1368, layers=8, steps=8)}


def _hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(url: str, out: Path, case: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.helpers.dist_worker import TinyLlama
    from vllm_deltasync import DeltaPublisher

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with torch.device("meta"):
        model = TinyLlama(vocab=case["vocab"], h=case["h"], i=case["i"], layers=case["layers"],
                          heads=case["h"] // 64, kv=max(1, case["h"] // 128))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            else:
                local.copy_(torch.randn(local.shape, generator=gen) * 0.02)
    model.to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    shard_bytes = sum(p.to_local().numel() * 2 for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-6, weight_decay=0.0)
    ids = torch.randint(0, case["vocab"], (1, 9), generator=gen)

    def train() -> float:
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return (time.perf_counter() - t0) * 1e3

    steps = case["steps"]
    for _ in range(steps):  # the same steps without publishing: the baseline peak
        train()
    base_hwm = _hwm_mib()
    opt_ms, pub_ms = [], []
    with DeltaPublisher(url, anchor_every=10, timeout_s=120) as pub:
        for step in range(steps):
            opt_ms.append(train())
            t0 = time.perf_counter()
            pub.publish(step, model.named_parameters())
            pub_ms.append((time.perf_counter() - t0) * 1e3)
        pub.flush()
        per_step = list(pub.stats.per_step)
        manifest = pub.stats.last_manifest
    report = {
        "rank": rank, "params": params, "shard_mib": shard_bytes / 2**20,
        "opt_ms": statistics.median(opt_ms), "publish_ms": statistics.median(pub_ms[1:]),
        "anchor_publish_ms": pub_ms[0],
        "upload_ms_delta": statistics.median(u * 1e3 for _, _, u in per_step[1:]),
        "upload_ms_anchor": per_step[0][2] * 1e3,
        "extra_hwm_mib": _hwm_mib() - base_hwm, "base_hwm_mib": base_hwm,
        "changed": manifest.totals.changed if manifest else None,
        "delta_bytes": manifest.totals.bytes if manifest else None,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def _launch(nproc: int, case_name: str, workdir: Path, timeout: float = 900) -> list[dict]:
    out = workdir / f"{case_name}-{nproc}"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), __file__, "--worker",
         f"file://{out}/bucket", str(out), "--case", case_name],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
        start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    if proc.returncode != 0:
        raise RuntimeError(output[-4000:])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def run(quick: bool = False, nproc: int = 2) -> str:
    case_name = "quick" if quick else "full"
    case = CASES[case_name]
    with tempfile.TemporaryDirectory() as tmp:
        reports = _launch(nproc, case_name, Path(tmp))
    lines = [
        "### Sharded publisher (FSDP2, CPU, gloo)",
        "",
        f"Llama-shaped model h{case['h']} L{case['layers']} vocab {case['vocab']}, built on the meta "
        f"device and sharded before any storage exists; {nproc} ranks (`torchrun`, gloo, one "
        "thread each), bf16 weights, AdamW lr 3e-6, 1 x 8 tokens per step, file:// bucket, "
        f"{case['steps']} steps (first an anchor). Extra peak RSS: VmHWM after the publishing "
        "steps minus VmHWM after as many training steps without the publisher.",
        "",
        "| rank | params (full) | bf16 shard | optimizer.step ms | publish() ms (delta) | publish() ms (anchor) "
        "| upload ms (delta) | upload ms (anchor) | extra peak RSS | delta bytes/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        delta = "" if r["delta_bytes"] is None else f"{r['delta_bytes'] / 1024:.1f} KiB"
        lines.append(
            f"| {r['rank']}{' (commits)' if r['rank'] == 0 else ''} | {r['params'] / 1e6:.2f}M | "
            f"{r['shard_mib']:.1f} MiB | {r['opt_ms']:.1f} | {r['publish_ms']:.1f} | "
            f"{r['anchor_publish_ms']:.1f} | {r['upload_ms_delta']:.1f} | {r['upload_ms_anchor']:.1f} | "
            f"{r['extra_hwm_mib']:.1f} MiB | {delta} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("URL", "OUT"))
    ap.add_argument("--case", default="full")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]), CASES[args.case])
        return
    print(run(args.quick, args.nproc))


if __name__ == "__main__":
    main()

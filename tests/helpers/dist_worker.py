"""One rank of a sharded training job, run under ``torchrun`` (CPU, gloo) by
``tests/helpers/torchrun.py`` for the sharded trainer's tests and the engine that follows one.

    torchrun --nproc-per-node 2 tests/helpers/dist_worker.py SCENARIO URL OUT [--init DIR] [--fail-url URL2]

Scenarios:

* ``fsdp``: a tiny Llama-shaped model (checkpoint names of ``LlamaForCausalLM``, plain torch so
  no ``transformers`` import), ``fully_shard`` per layer and at the root, vocab 101 (an uneven
  dim-0 shard), AdamW for several steps, ``publish`` every step; then a restart: a second
  publisher under a new run id continues (its first step is an anchor).
* ``tp``: DTensors placed by hand: ``Shard(1)`` (uneven columns), ``Shard(0)``, ``Replicate()``,
  a plain tensor (a replica), and, with 4 ranks, a 2-D mesh (``Shard(0)``, ``Shard(1)``).
* ``fail``: like ``tp`` with the test failpoint set on rank 1 at step 2; every rank records the
  error it gets and when, then keeps publishing (recovery by anchor).
* ``placement``: step 0 with parameter ``w`` a plain tensor on rank 0 and a ``Shard(0)``
  DTensor on rank 1 (every rank records its error), then steps 1 and 2 placed alike.

Rank 0 saves the full model gathered **here only** (``full_tensor()``, test side) after every
step as ``OUT/truth-<step>.safetensors``; every rank writes ``OUT/rank<r>.json`` (errors, times).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from vllm_deltasync import DeltaPublisher, failpoints
from vllm_deltasync.errors import PublishError

WRITER = "5a4dc0de5a4dc0de"


# ---------------------------------------------------------------------------- tiny Llama
class RMSNorm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, h: int, heads: int, kv: int) -> None:
        super().__init__()
        self.heads, self.kv, self.dim = heads, kv, h // heads
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv * self.dim, bias=False)
        self.v_proj = nn.Linear(h, kv * self.dim, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.dim).transpose(1, 2)
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, h: int, i: int, heads: int, kv: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(h)
        self.self_attn = Attention(h, heads, kv)
        self.post_attention_layernorm = RMSNorm(h)
        self.mlp = MLP(h, i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, vocab: int, h: int, i: int, layers: int, heads: int, kv: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Layer(h, i, heads, kv) for _ in range(layers))
        self.norm = RMSNorm(h)


class TinyLlama(nn.Module):
    """``LlamaForCausalLM``'s parameter names and shapes (untied embeddings)."""

    def __init__(self, vocab: int = 101, h: int = 64, i: int = 96, layers: int = 2, heads: int = 2,
                 kv: int = 1) -> None:
        super().__init__()
        self.model = Inner(vocab, h, i, layers, heads, kv)
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def _gathered(pairs) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The full model in bf16 (collective): the test's ground truth, never the publisher's."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in pairs:
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        out[name] = full.to(torch.bfloat16).contiguous()
    return out


def _dims(init: str | None) -> dict[str, int]:
    """TinyLlama's sizes: the defaults, or those of the Hugging Face checkpoint in ``init``."""
    if not init:
        return {"vocab": 101, "h": 64, "i": 96, "layers": 2, "heads": 2, "kv": 1}
    cfg = json.loads((Path(init) / "config.json").read_text())
    return {"vocab": cfg["vocab_size"], "h": cfg["hidden_size"], "i": cfg["intermediate_size"],
            "layers": cfg["num_hidden_layers"], "heads": cfg["num_attention_heads"],
            "kv": cfg["num_key_value_heads"]}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------- scenarios
def fsdp(url: str, out: Path, args: argparse.Namespace) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    dims = _dims(args.init)
    model = TinyLlama(**dims)
    if args.init:
        state = load_file(str(Path(args.init) / "model.safetensors"))
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    times: list[dict[str, float]] = []
    steps_a, steps_b = range(args.steps), range(args.steps, args.steps + 3)

    def train_and_publish(pub: DeltaPublisher, step: int) -> None:
        ids = torch.randint(0, dims["vocab"], (2, 16), generator=gen)
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t1 = time.perf_counter()
        pub.publish(step, model.named_parameters())
        t2 = time.perf_counter()
        times.append({"step": step, "optimizer_ms": (t1 - t0) * 1e3, "publish_ms": (t2 - t1) * 1e3})
        truth = _gathered(model.named_parameters())
        if rank == 0:
            save_file(truth, str(out / f"truth-{step}.safetensors"))

    with DeltaPublisher(url, anchor_every=3, keep_anchors=2, writer_token=WRITER,
                        run_id="aaaa0000aaaa0000", timeout_s=args.timeout) as pub:
        for step in steps_a:
            train_and_publish(pub, step)
        pub.flush()
    # a restart: a new publisher, a new run id, the same job token (cleans its own data)
    with DeltaPublisher(url, anchor_every=3, keep_anchors=2, writer_token=WRITER,
                        run_id="bbbb0000bbbb0000", timeout_s=args.timeout) as pub:
        for step in steps_b:
            train_and_publish(pub, step)
    return {"times": times, "peak_rss_mib": _peak_rss_mib()}


def _placed(world: int) -> tuple[dict[str, torch.Tensor], list[tuple]]:
    """Full fp32 parameters and how each is placed: ``(name, mesh_shape, placements)``."""
    from torch.distributed.tensor import Replicate, Shard

    gen = torch.Generator().manual_seed(7)
    full = {
        "col.weight": torch.randn(6, 7, generator=gen) * 0.02,       # Shard(1): 4 + 3 columns
        "row.weight": torch.randn(9, 5, generator=gen) * 0.02,       # Shard(0): 5 + 4 rows
        "norm.weight": 1 + 0.1 * torch.randn(7, generator=gen),      # Replicate()
        "cube.weight": torch.randn(3, 4, 5, generator=gen) * 0.02,   # Shard(2) of a 3-D tensor
        "plain.bias": torch.randn(11, generator=gen) * 0.02,         # a plain tensor: a replica
    }
    how: list[tuple] = [
        ("col.weight", (world,), [Shard(1)]),
        ("row.weight", (world,), [Shard(0)]),
        ("norm.weight", (world,), [Replicate()]),
        ("cube.weight", (world,), [Shard(2)]),
        ("plain.bias", None, None),
    ]
    if world == 4:  # FSDP x TP: rows over dp, columns over tp
        full["fsdp_tp.weight"] = torch.randn(7, 9, generator=gen) * 0.02
        how.append(("fsdp_tp.weight", (2, 2), [Shard(0), Shard(1)]))
        full["dp_rep.weight"] = torch.randn(5, 6, generator=gen) * 0.02
        how.append(("dp_rep.weight", (2, 2), [Replicate(), Shard(1)]))
    return full, how


def tp(url: str, out: Path, args: argparse.Namespace, *, fail: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    full, how = _placed(world)
    meshes = {shape: init_device_mesh("cpu", shape) for _, shape, _ in how if shape is not None}
    params: dict[str, torch.Tensor] = {}
    for name, shape, placements in how:
        params[name] = full[name].clone() if shape is None else distribute_tensor(
            full[name].clone(), meshes[shape], placements)
    if fail:
        os.environ.update(failpoints.env(failpoints.spec("shard", 1, 2)))
    report: dict = {"errors": []}
    gen = torch.Generator().manual_seed(11)  # the same on every rank: replicas stay equal
    with DeltaPublisher(url, anchor_every=4, writer_token=WRITER, timeout_s=args.timeout) as pub:
        for step in range(args.steps):
            for name, shape, placements in how:  # a sparse update, as an optimizer step would
                upd = torch.randn(full[name].shape, generator=gen) * 1e-2
                upd *= torch.rand(full[name].shape, generator=gen) < 0.2
                p = params[name]
                if shape is not None:
                    upd = distribute_tensor(upd, meshes[shape], placements)
                p.add_(upd)
            t0 = time.monotonic()
            if fail and step == 3:
                report["since_failed_step_s"] = t0 - report["failed_step_returned"]
            try:
                pub.publish(step, params.items())
            except PublishError as exc:  # the failing rank raises its own RuntimeError
                report["errors"].append({"step": step, "error": f"{type(exc).__name__}: {exc}",
                                         "after_s": time.monotonic() - t0,
                                         "since_failed_step_s": time.monotonic() - report.get(
                                             "failed_step_returned", t0)})
            except RuntimeError as exc:
                report["errors"].append({"step": step, "error": f"{type(exc).__name__}: {exc}",
                                         "after_s": time.monotonic() - t0,
                                         "since_failed_step_s": time.monotonic() - report.get(
                                             "failed_step_returned", t0)})
            if fail and step == 2:
                report["failed_step_returned"] = time.monotonic()
                time.sleep(0.5)  # let the committer see the abort before the next call
            truth = _gathered(params.items())
            if rank == 0:
                save_file(truth, str(out / f"truth-{step}.safetensors"))
    return report


def placement(url: str, out: Path, args: argparse.Namespace) -> dict:
    """The ranks disagree on how ``w`` is held at step 0: every rank must raise, nothing commit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    full = {"w": torch.arange(24, dtype=torch.float32).view(6, 4),
            "ok": torch.arange(10, dtype=torch.float32)}

    def shard(t: torch.Tensor) -> torch.Tensor:  # even dim-0 shards, no communication
        return DTensor.from_local(t.chunk(world)[rank].clone(), mesh, [Shard(0)], run_check=False)

    report: dict = {"errors": []}
    with DeltaPublisher(url, anchor_every=4, writer_token=WRITER, timeout_s=args.timeout) as pub:
        for step in range(3):
            params = {"ok": shard(full["ok"] + step)}
            if step == 0 and rank == 0:
                params["w"] = full["w"].clone()  # a plain tensor: "a replica written by rank 0"
            else:
                params["w"] = shard(full["w"] + step)
            try:
                pub.publish(step, params.items())
            except PublishError as exc:
                report["errors"].append({"step": step, "error": f"{type(exc).__name__}: {exc}"})
            if rank == 0:
                save_file({"w": (full["w"] + step).to(torch.bfloat16),
                           "ok": (full["ok"] + step).to(torch.bfloat16)},
                          str(out / f"truth-{step}.safetensors"))
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["fsdp", "tp", "fail", "placement"])
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--init", default=None)
    ap.add_argument("--fail-url", default=None, help="tp: then the failpoint run on this bucket")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        if args.scenario == "fsdp":
            report = fsdp(args.url, out, args)
        elif args.scenario == "placement":
            report = placement(args.url, out, args)
        else:
            report = tp(args.url, out, args, fail=args.scenario == "fail")
        report["wall_s"] = time.monotonic() - started
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
        if args.fail_url:
            (out / "fail").mkdir(exist_ok=True)
            dist.barrier()
            failed = tp(args.fail_url, out / "fail", args, fail=True)
            (out / "fail" / f"rank{dist.get_rank()}.json").write_text(json.dumps(failed))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

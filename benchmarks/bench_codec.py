"""Codec benchmark: bytes per step and per changed element, encode/decode throughput vs memcpy.

The deltas are real: a Llama-shaped model (``examples/toymodel.py``) trained with AdamW on
fp32 master weights, published as bf16 (mixed precision, as RL trainers do); the delta of one
step is every element whose bf16 bit pattern changed between two consecutive steps. Two tensor
sets: a 37.8M-parameter toy (small tensors, where each tensor's fixed bytes weigh) and one
Llama-2-7B decoder layer (236M parameters, tensors of a real model's size). Every codec
encodes the same deltas. Sizes are given twice: payload only (the encoded roles), and
all bytes of the step (the step published by ``DeltaPublisher`` to a temporary ``file://``
bucket: data files with their safetensors headers, plus the manifest). Throughput is
single-threaded CPU time (``time.thread_time``), i.e. per core, and is compared with a memcpy
of the same number of encoded bytes. A dense-fallback table checks synthetic steps at 10-100%
density against the dense bf16 size.

    python -m benchmarks.bench_codec [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from vllm_deltasync.format import sparse_v3
from vllm_deltasync.format.codec import Codec
from vllm_deltasync.format.codecs import get_codec, prepare_decoders
from vllm_deltasync.format.manifest import load_document

LRS = (1e-7, 1e-6, 3e-6, 1e-5)
"""1e-7: ~0.1% of elements change per step; 1e-6: ~1%; 3e-6: ~3%; 1e-5: ~12%."""
TOY = dict(hidden_size=768, num_layers=4, num_heads=12, num_kv_heads=4, intermediate_size=2048,
           vocab_size=8192)
"""37.8M parameters in 30 tensors of up to 6.3M: small tensors, so fixed per-tensor bytes weigh."""
LAYER_7B = dict(hidden_size=4096, num_layers=1, num_heads=32, num_kv_heads=32, intermediate_size=11008,
                vocab_size=4096)
"""236M parameters: one decoder layer of Llama-2-7B (q/k/v/o 4096 x 4096, gate/up/down 4096 x 11008),
with a 4096-token vocabulary: tensors of the size real models have (a 7B model: 291 tensors,
24M parameters each on average)."""
QUICK = dict(hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=4, intermediate_size=768,
             vocab_size=2048)
QUICK_LAYER = dict(hidden_size=1024, num_layers=1, num_heads=8, num_kv_heads=8, intermediate_size=2752,
                   vocab_size=1024)
CODECS = ("sparse-v1", "sparse-v2", "sparse-v2-zstd", "sparse-v3")
WARMUP_STEPS = 3


@dataclass
class Delta:
    """One optimizer step's change of a bf16 checkpoint."""

    lr: float
    old: dict[str, torch.Tensor]
    new: dict[str, torch.Tensor]

    def changed(self) -> dict[str, torch.Tensor]:
        """name -> int64 flat indices of elements whose bf16 bits changed."""
        out = {}
        for name, old in self.old.items():
            diff = old.view(-1).view(torch.int16) != self.new[name].view(-1).view(torch.int16)
            out[name] = torch.nonzero(diff).flatten()
        return out

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.old.values())


def _model(shape: dict[str, int]) -> torch.nn.Module:
    try:
        from examples.toymodel import build_model, load_hf_model
    except ImportError:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_layers"],
                          num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                          intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"])
        return LlamaForCausalLM(cfg).float()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(tmp, "llama", **shape)  # type: ignore[arg-type]
        return load_hf_model(path, dtype=torch.float32).train()


def make_deltas(lrs: tuple[float, ...] = LRS, *, quick: bool = False, seed: int = 0,
                shape: dict[str, int] | None = None) -> list[Delta]:
    """One real AdamW step delta per learning rate, after ``WARMUP_STEPS`` steps, of a Llama of
    ``shape`` (default: ``TOY``, or ``QUICK`` when ``quick``). Trains with every core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        return _train(lrs, quick, seed, shape or (QUICK if quick else TOY))
    finally:
        torch.set_num_threads(threads)


def _train(lrs: tuple[float, ...], quick: bool, seed: int, shape: dict[str, int]) -> list[Delta]:
    model = _model(shape)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    vocab = int(model.config.vocab_size)  # type: ignore[union-attr,arg-type]
    batch, seq = (2, 64) if quick else (2, 128)
    deltas = []
    first: list[torch.Tensor | None] | None = None  # step 1's gradients: the same for every lr
    for lr in lrs:
        model.load_state_dict(start)
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        snaps: list[dict[str, torch.Tensor]] = []
        for i in range(WARMUP_STEPS + 1):
            ids = torch.randint(0, vocab, (batch, seq), generator=gen)
            if i == 0 and first is not None:  # same weights, same batch: reuse, bit for bit
                for p, g in zip(model.parameters(), first, strict=True):
                    p.grad = None if g is None else g.clone()
            else:
                model(input_ids=ids, labels=ids).loss.backward()
                if i == 0:
                    first = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
            snaps = [*snaps[-1:], {k: p.detach().to(torch.bfloat16) for k, p in model.named_parameters()}]
        deltas.append(Delta(lr, snaps[0], snaps[1]))
    return deltas


def encode_all(codec: Codec, delta: Delta, changed: dict[str, torch.Tensor], repeat: int = 1
               ) -> tuple[list, float]:
    """[(roles, meta, count)] for every tensor, and the encode CPU seconds (each tensor's best
    of ``repeat``)."""
    out, seconds = [], 0.0
    for name, idx in changed.items():
        old, new = delta.old[name].view(-1)[idx], delta.new[name].view(-1)[idx]
        best = float("inf")
        for _ in range(repeat):
            t = time.thread_time()
            roles, meta = codec.encode(idx, new, old)
            best = min(best, time.thread_time() - t)
        seconds += best
        out.append((roles, meta, idx.numel()))
    return out, seconds


def _parallel_encode_s(codec: Codec, delta: Delta, changed: dict[str, torch.Tensor], threads: int,
                       repeat: int) -> float:
    """Wall seconds to encode every tensor once, tensors spread over ``threads`` threads (as the
    writer's pool spreads chunks), best of ``repeat``."""
    work = [(idx, delta.old[name].view(-1)[idx], delta.new[name].view(-1)[idx])
            for name, idx in changed.items()]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat):
            t = time.perf_counter()
            list(pool.map(lambda w: codec.encode(w[0], w[2], w[1]), work))
            best = min(best, time.perf_counter() - t)
    return best


def _nbytes(encoded: list) -> int:
    return sum(t.numel() * t.element_size() for roles, _, _ in encoded for t in roles.values())


def _best_cpu_s(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def published_bytes(codec: str, delta: Delta, format_version: int | None = None) -> tuple[int, int, int]:
    """(data file bytes, manifest bytes, changed elements) of ``delta`` published as one step
    (in the publisher's default format version unless ``format_version`` is given).

    The base is published first as an anchor to a temporary ``file://`` bucket, then the new
    weights as a delta with ``codec``; the delta step's files and manifest are counted on disk.
    """
    from vllm_deltasync.trainer.publisher import DeltaPublisher

    with tempfile.TemporaryDirectory() as tmp:
        options = {} if format_version is None else {"format_version": format_version}
        with DeltaPublisher(f"file://{tmp}", codec=codec, anchor_every=1000, **options) as pub:
            pub.publish(0, delta.old)
            pub.publish(1, delta.new)
        with open(os.path.join(tmp, "manifests", f"{1:012d}.json"), "rb") as f:
            manifest = f.read()
        doc = load_document(manifest)
        assert doc["kind"] == "delta"
        data = sum(os.path.getsize(os.path.join(tmp, f["path"])) for f in doc["files"])
        return data, len(manifest), int(doc["totals"]["changed"])


def size_table(deltas: list[Delta]) -> tuple[str, dict[tuple[float, str], float]]:
    """Payload B/el, all-bytes B/el (files + headers + manifest) and step / full bf16, per codec."""
    rows = ["| lr | changed | " + " | ".join(f"{c} B/el | {c} all B/el | {c} step/full" for c in CODECS)
            + f" | {CODECS[-1]} all B/el, format 2 manifest |",
            "|---|---|" + "---|---|---|" * len(CODECS) + "---|"]
    per_el: dict[tuple[float, str], float] = {}
    for delta in deltas:
        changed = delta.changed()
        n = sum(i.numel() for i in changed.values())
        cells = []
        for name in CODECS:
            nbytes = _nbytes(encode_all(get_codec(name), delta, changed)[0])
            data, manifest, published = published_bytes(name, delta)
            assert published == n, (published, n)
            per_el[(delta.lr, name)] = nbytes / max(n, 1)
            per_el[(delta.lr, name + " all")] = (data + manifest) / max(n, 1)
            cells.append(f"{nbytes / max(n, 1):.3f} | {(data + manifest) / max(n, 1):.3f} | "
                         f"{(data + manifest) / (2 * delta.numel):.5f}")
        data, manifest, _ = published_bytes(CODECS[-1], delta, format_version=2)
        cells.append(f"{(data + manifest) / max(n, 1):.3f}")
        rows.append(f"| {delta.lr:g} | {n:,} ({n / delta.numel:.2%}) | " + " | ".join(cells) + " |")
    return "\n".join(rows), per_el


def dense_fallback_table(delta: Delta, densities: tuple[float, ...] = (0.1, 0.5, 0.9, 1.0),
                         max_params: int = 6_000_000) -> str:
    """Synthetic steps at high density on the model's weights: encoded bytes / dense bf16 bytes.

    ``small``: changed elements move by +-1..3 ulps (like real steps); ``random``: they take
    arbitrary new bits. The rule for ``sparse-v3``: never more than dense + 1%.
    """
    gen = torch.Generator().manual_seed(0)
    names, total = [], 0
    for name, t in sorted(delta.old.items(), key=lambda kv: -kv[1].numel()):
        if total + t.numel() <= max_params:
            names.append(name)
            total += t.numel()
    rows = ["| density | values | " + " | ".join(f"{c} / dense" for c in CODECS) + " |",
            "|---|---|" + "---|" * len(CODECS)]
    for density in densities:
        for kind in ("small", "random"):
            sizes = dict.fromkeys(CODECS, 0)
            for name in names:
                old = delta.old[name].reshape(-1)
                idx = torch.nonzero(torch.rand(old.numel(), generator=gen) < density).flatten()
                ob = old[idx].view(torch.int16).to(torch.int32)
                if kind == "small":
                    step = torch.randint(1, 4, (idx.numel(),), generator=gen) * (
                        torch.randint(0, 2, (idx.numel(),), generator=gen) * 2 - 1)
                else:
                    step = torch.randint(1, 1 << 16, (idx.numel(),), generator=gen)
                new = ((ob + step) & 0xFFFF).to(torch.int16).view(torch.bfloat16)
                for c in CODECS:
                    roles, _ = get_codec(c).encode(idx, new, old[idx])
                    sizes[c] += sum(t.numel() * t.element_size() for t in roles.values())
            rows.append(f"| {density:.0%} | {kind} | " + " | ".join(f"{sizes[c] / (2 * total):.4f}" for c in CODECS) + " |")
    return (f"Tensors: the largest of the model up to {total / 1e6:.1f}M parameters; dense = 2 bytes per "
            "element of those tensors (payload bytes).\n\n" + "\n".join(rows))


def throughput_table(delta: Delta, repeat: int = 21) -> str:
    """Encode/decode GB/s of encoded bytes per core, and the same bytes through memcpy."""
    changed = delta.changed()
    n = sum(i.numel() for i in changed.values())
    rows = ["| codec | B/el | encode GB/s | encode ns/el | encode M el/s | encode wall s, 1 / 2 threads | "
            "decode GB/s | memcpy GB/s | decode ns/el | "
            "decode M el/s | decode / memcpy | decode ns/el, largest tensor | decode wall s, 1 / 2 threads |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    big = max(range(len(changed)), key=lambda k: list(changed.values())[k].numel())
    big_n = list(changed.values())[big].numel()
    encoded = {name: encode_all(get_codec(name), delta, changed, repeat=3) for name in CODECS}
    enc_walls = {name: [_parallel_encode_s(get_codec(name), delta, changed, threads, 3) for threads in (1, 2)]
                 for name in CODECS}
    # sparse-v3 twice where numba is present: its numba kernel and its numpy fallback
    rows_of = [(name, name, None) for name in CODECS]
    if sparse_v3._kernel() is not None:
        rows_of[-1:] = [("sparse-v3", "sparse-v3", sparse_v3._kernel()),
                        ("sparse-v3, numpy decoder", "sparse-v3", "numpy")]
    # decode timings interleaved (every codec once per round, best round kept), so that a busy
    # moment of a shared machine does not land on one codec only
    times = {label: [float("inf")] * len(changed) for label, _, _ in rows_of}
    for _ in range(repeat):
        for label, name, kernel in rows_of:
            codec = get_codec(name)
            with _v3_decoder(kernel):
                for k, (r, m, c) in enumerate(encoded[name][0]):
                    t = time.thread_time()
                    codec.decode(r, m, c)
                    times[label][k] = min(times[label][k], time.thread_time() - t)
    for label, name, kernel in rows_of:
        codec = get_codec(name)
        chunks, enc_s = encoded[name]
        nbytes = _nbytes(chunks)
        dec_s = sum(times[label])
        src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
        dst = torch.empty_like(src)
        cpy_s = _best_cpu_s(functools.partial(dst.copy_, src), repeat * 3)
        with _v3_decoder(kernel):
            walls = [_parallel_decode_s(codec, chunks, threads, repeat) for threads in (1, 2)]
        enc_wall = enc_walls[name]
        rows.append(f"| {label} | {nbytes / n:.3f} | {nbytes / enc_s / 1e9:.3f} | {enc_s / n * 1e9:.1f} | "
                    f"{n / enc_s / 1e6:.0f} | {enc_wall[0]:.3f} / {enc_wall[1]:.3f} | "
                    f"{nbytes / dec_s / 1e9:.3f} | {nbytes / cpy_s / 1e9:.2f} | {dec_s / n * 1e9:.2f} | "
                    f"{n / dec_s / 1e6:.0f} | {cpy_s / dec_s:.3f} | {times[label][big] / big_n * 1e9:.2f} | "
                    f"{walls[0]:.3f} / {walls[1]:.3f} |")
    biggest = list(changed)[big]
    rows.append(f"\nLargest tensor: `{biggest}`, {big_n:,} changed elements. The first "
                "columns sum every tensor's decode, so they include the per-call overhead of small tensors. "
                "Encode columns: CPU time of one thread (per core), each tensor's best of 3; encode wall s: "
                "every tensor encoded once, tensors spread over a pool of 1 or 2 threads (as the writer's "
                "`encode_threads` pool spreads chunks), best of 3. sparse-v3 encodes with its numba kernels "
                "where numba is present (its numpy fallback writes the same bytes). "
                "Last column: wall time to decode every tensor once, tensors spread over a thread pool "
                "(decoders release the GIL in numpy, torch, zstd and numba), best of the repeats. "
                f"Decode columns: best of {repeat} rounds, every codec once per round. "
                + ("sparse-v3 decodes with its numba kernel (numba comes with vLLM); the numpy "
                   "decoder row is its fallback where numba is missing."
                   if sparse_v3._kernel() is not None else
                   "sparse-v3 decoded with its numpy fallback: numba is not installed here."))
    return "\n".join(rows)


@contextlib.contextmanager
def _v3_decoder(kernel: object) -> Iterator[None]:
    """sparse-v3 decodes with numba's kernel (``kernel``), the numpy passes ("numpy"), or as
    configured (None)."""
    if kernel is None:
        yield
        return
    saved = list(sparse_v3._KERNEL)
    sparse_v3._KERNEL[:] = [None if kernel == "numpy" else kernel]
    try:
        yield
    finally:
        sparse_v3._KERNEL[:] = saved


def _parallel_decode_s(codec: Codec, encoded: list, threads: int, repeat: int) -> float:
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat):
            t = time.perf_counter()
            list(pool.map(lambda e: codec.decode(*e), encoded))
            best = min(best, time.perf_counter() - t)
    return best


def run(quick: bool = False) -> str:
    """The codec section of RESULTS.md (Markdown)."""
    torch.set_num_threads(1)
    prepare_decoders()  # sparse-v3's numba kernel compiles here, not in a timed decode
    sparse_v3._encode_kernels()  # and its encoder's, not in a timed encode
    t0 = time.perf_counter()
    deltas = make_deltas(quick=quick)
    model_params = deltas[0].numel
    sizes, _ = size_table(deltas)
    thr = throughput_table(deltas[LRS.index(3e-6)])
    thr1 = throughput_table(deltas[LRS.index(1e-6)])
    dense = dense_fallback_table(deltas[0], max_params=1_000_000 if quick else 6_000_000)
    del deltas
    shape = QUICK_LAYER if quick else LAYER_7B
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    layer = make_deltas((1e-7, 1e-6), shape=shape)
    layer_sizes, _ = size_table(layer)
    layer_thr = throughput_table(layer[1], repeat=11)
    layer_params = layer[0].numel
    del layer
    return (
        f"### Codec size (one AdamW step, fp32 master -> bf16, {model_params / 1e6:.1f}M-parameter "
        f"Llama-shaped model, {WARMUP_STEPS} warm-up steps)\n\n"
        "B/el: encoded payload bytes per changed element; all B/el: every byte of the published "
        "step per changed element (data files with their safetensors headers, plus the manifest; "
        "`DeltaPublisher` to a temporary file:// bucket, format version 3: the manifest's tensor "
        "table deflated); step/full: all bytes of the step / the full bf16 checkpoint. Last "
        "column: the same step published with `format_version=2` (plain JSON tensor table, as "
        "0.3.0 wrote it). This model's tensors are small (30 tensors, up to 6.3M elements): "
        "each tensor's fixed bytes (its manifest entry with a sha256, its safetensors header "
        "entry, its entropy tables) weigh on sparse steps; the next table has tensors of a real "
        "model's size.\n\n"
        f"{sizes}\n\n"
        f"### Codec size on tensors of a 7B model's size ({layer_params / 1e6:.0f}M parameters: "
        f"{'a quarter-width copy of ' if quick else ''}one Llama-2-7B decoder layer, q/k/v/o "
        f"{h} x {h}, gate/up/down {h} x {inter}, with embedding and head for a {vocab}-token "
        f"vocabulary; same training, {WARMUP_STEPS} warm-up steps)\n\n"
        f"{layer_sizes}\n\n"
        f"### Dense fallback (synthetic steps at high density)\n\n{dense}\n\n"
        f"### Codec throughput (lr 3e-6 delta, one core, CPU time)\n\n{thr}\n\n"
        f"### Codec throughput (lr 1e-6 delta, ~1% changed, one core, CPU time)\n\n{thr1}\n\n"
        "### Codec throughput on tensors of a 7B model's size (lr 1e-6 delta, ~1% changed, "
        f"one core, CPU time)\n\n{layer_thr}\n\n"
        "GPU decode + apply: the `gpu` section (benchmarks/bench_gpu.py).\n\n"
        f"_codec benchmark: {time.perf_counter() - t0:.0f} s_\n"
    )


def gpu_apply_section(quick: bool) -> str:
    """Decode + apply of a 1% sparse-v2 delta on 7B-shaped tensors, CUDA events; skipped w/o CUDA."""
    if not torch.cuda.is_available():
        return "### GPU decode + apply (7B shapes)\n\nskipped: no CUDA device on this machine."
    return "### GPU decode + apply (7B shapes, 1% delta, TP=2 index translation)\n\n" + gpu_apply_table(
        "cuda", quick=quick)


def _llama_shapes(quick: bool) -> list[tuple[str, tuple[int, int], int]]:
    """(name, full shape, TP split dim) of a Llama-2-7B (quick: a 1/16-wide, 2-layer one)."""
    h, inter, vocab, layers = (256, 688, 2000, 2) if quick else (4096, 11008, 32000, 32)
    out = [("model.embed_tokens.weight", (vocab, h), 0), ("lm_head.weight", (vocab, h), 0)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h), 0), (p + "self_attn.k_proj.weight", (h, h), 0),
                (p + "self_attn.v_proj.weight", (h, h), 0), (p + "self_attn.o_proj.weight", (h, h), 1),
                (p + "mlp.gate_proj.weight", (inter, h), 0), (p + "mlp.up_proj.weight", (inter, h), 0),
                (p + "mlp.down_proj.weight", (h, inter), 1)]
    return out


def _tp_local(idx: torch.Tensor, shape: tuple[int, int], dim: int, rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint flat indices -> (selection mask, this rank's local flat indices)."""
    rows, cols = shape
    if dim == 0:
        per = rows // tp * cols
        keep = (idx >= rank * per) & (idx < (rank + 1) * per)
        return keep, idx[keep] - rank * per
    width = cols // tp
    col = idx % cols
    keep = (col >= rank * width) & (col < (rank + 1) * width)
    sel = idx[keep]
    return keep, (sel // cols) * width + (sel % cols - rank * width)


def gpu_apply_table(device: str, *, quick: bool = False, density: float = 0.01, tp: int = 2) -> str:
    """Decode (sparse-v2 on ``device``) + TP translation + in-place apply, rank 0 of ``tp``."""
    dev = torch.device(device)
    codec, gen = get_codec("sparse-v2"), torch.Generator().manual_seed(0)
    work = []
    for name, shape, dim in _llama_shapes(quick):
        numel = shape[0] * shape[1]
        idx = torch.nonzero(torch.rand(numel, generator=gen) < density).flatten()
        old = (torch.randn(idx.numel(), generator=gen) * 0.02).to(torch.bfloat16)
        diff = torch.randint(1, 3, (idx.numel(),), generator=gen, dtype=torch.int16)
        new = (old.view(torch.int16) + diff * torch.where(torch.rand(idx.numel(), generator=gen) < 0.5, 1, -1).to(torch.int16))
        roles, meta = codec.encode(idx, new.view(torch.bfloat16), old)
        local_shape = (shape[0] // tp, shape[1]) if dim == 0 else (shape[0], shape[1] // tp)
        param = torch.randn(local_shape, generator=gen).to(torch.bfloat16).to(dev)
        work.append((name, shape, dim, roles, meta, idx.numel(), param))
    return _time_apply(work, dev, tp)


def _time_apply(work: list, dev: torch.device, tp: int) -> str:
    cuda = dev.type == "cuda"
    timer = _CudaTimer() if cuda else _WallTimer()
    host = [{r: (t.pin_memory() if cuda else t) for r, t in roles.items()} for _, _, _, roles, _, _, _ in work]
    probe = work[-1][6].clone()
    codec = get_codec("sparse-v2")
    enc_bytes = sum(t.numel() * t.element_size() for h in host for t in h.values())
    changed = sum(w[5] for w in work)
    timer.start()
    on_dev = [{r: t.to(dev, non_blocking=True) for r, t in h.items()} for h in host]
    t_copy = timer.lap()
    decoded = [codec.decode(d, w[4], w[5]) for d, w in zip(on_dev, work, strict=True)]
    t_decode = timer.lap()
    local = [_tp_local(_indices(i), w[1], w[2], 0, tp) for (i, _, _), w in zip(decoded, work, strict=True)]
    t_translate = timer.lap()
    for (keep, li), (_, v, _), w in zip(local, decoded, work, strict=True):
        bits = w[6].view(-1).view(torch.int16)
        bits.index_add_(0, li, v[keep])
    t_apply = timer.lap()
    keep, li = local[-1]
    expect = probe.view(-1).view(torch.int16).index_add_(0, li, decoded[-1][1][keep])
    if not torch.equal(expect, work[-1][6].view(-1).view(torch.int16)):
        raise RuntimeError("GPU apply did not reproduce the expected bits")
    params = sum(w[1][0] * w[1][1] for w in work)
    total = t_copy + t_decode + t_translate + t_apply
    return ("| params | changed | encoded MB | H2D ms | decode ms | TP translate ms | apply ms | total ms | decode GB/s |\n"
            "|---|---|---|---|---|---|---|---|---|\n"
            f"| {params / 1e6:,.1f}M | {changed / 1e6:.2f}M | {enc_bytes / 1e6:.2f} | {t_copy:.2f} | {t_decode:.2f} | "
            f"{t_translate:.2f} | {t_apply:.2f} | {total:.2f} | {enc_bytes / t_decode / 1e6:.1f} |\n\n"
            f"device: {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else dev.type}; bits of the applied "
            "shard checked against an independent index_add.")


def _indices(indices: torch.Tensor | None) -> torch.Tensor:
    if indices is None:
        raise RuntimeError("sparse-v2 decoded without indices")
    return indices


class _WallTimer:
    def start(self) -> None:
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        ms, self.t = (now - self.t) * 1e3, now
        return ms


class _CudaTimer:
    def start(self) -> None:
        torch.cuda.synchronize()
        self.ev = torch.cuda.Event(enable_timing=True)
        self.ev.record()

    def lap(self) -> float:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        ev.synchronize()
        ms = self.ev.elapsed_time(ev)
        self.ev = ev
        return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))


if __name__ == "__main__":
    main()

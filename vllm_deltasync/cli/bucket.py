"""Code for the commands of the bucket CLI (``inspect``, ``verify``, ``materialize``).

Each ``add_*`` builds its sub-parser and sets ``func`` to a callable
``(argparse.Namespace) -> int`` (the exit status); :mod:`vllm_deltasync.cli` lists them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from vllm_deltasync._urls import check_bucket_url, redact_url
from vllm_deltasync.errors import ConfigError, DeltaSyncError, FormatError, IntegrityError
from vllm_deltasync.format._listing import newest_readable
from vllm_deltasync.format.manifest import Manifest
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.stores import Store


# ---------------------------------------------------------------------------- inspect
def add_inspect(subparsers: Any) -> None:
    p = subparsers.add_parser("inspect", help="steps, kinds, bytes, sparsity and chains of a bucket")
    p.add_argument("url", help="bucket URL (file://, memory://, hf://, s3://)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=_run_inspect)


async def _load_all(reader: BucketReader) -> tuple[list[Manifest], list[str]]:
    manifests, problems = [], []
    for step in await reader.list_steps():
        try:
            manifests.append(await reader.manifest(step))
        except DeltaSyncError as exc:
            problems.append(str(exc))
    return manifests, problems


def _chains(manifests: list[Manifest]) -> list[dict[str, Any]]:
    by_step = {m.step: m for m in manifests}
    chains: dict[int, list[int]] = {}
    for m in manifests:
        chains.setdefault(m.anchor_step, []).append(m.step)
    out = []
    for anchor, steps in sorted(chains.items()):
        complete = anchor in by_step and all(
            by_step[s].kind == "anchor" or by_step[s].base_step in by_step for s in steps
        )
        out.append({"anchor": anchor, "first": steps[0], "last": steps[-1], "steps": len(steps),
                    "complete": complete})
    return out


def _step_row(m: Manifest) -> dict[str, Any]:
    return {"step": m.step, "kind": m.kind, "base_step": m.base_step, "anchor_step": m.anchor_step,
            "created_at": m.created_at, "files": len(m.files), "bytes": m.totals.bytes,
            "tensors": len(m.tensors), "changed": m.totals.changed, "elements": m.totals.elements,
            "sparsity": m.sparsity, "fingerprint": m.fingerprint,
            "format_version": m.schema_version, "run_id": m.run_id, "writer": m.writer}


def check_source(url: str) -> None:
    """A ``file://`` (or bare path) bucket that does not exist is an error, not an empty
    bucket: ``inspect``, ``verify`` and ``import-trl`` say so instead of "ok: 0 steps".
    A malformed URL or one carrying credentials is refused first, without echoing it."""
    check_bucket_url(url)
    if "://" in url and not url.startswith("file://"):
        return
    path = Path(url.removeprefix("file://"))
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise ConfigError(f"bucket {redact_url(url) if '://' in url else url} {what}")


def _run_inspect(args: argparse.Namespace) -> int:
    check_source(args.url)

    async def go() -> tuple[str, list[Manifest], list[str]]:
        async with BucketReader.open(args.url) as reader:
            manifests, problems = await _load_all(reader)
            return reader.store.url, manifests, problems

    url, manifests, problems = asyncio.run(go())
    rows, chains = [_step_row(m) for m in manifests], _chains(manifests)
    if args.json:
        print(json.dumps({"url": url, "steps": rows, "chains": chains, "problems": problems}, indent=2))
        return 0
    total = sum(r["bytes"] for r in rows)
    print(f"bucket {url}: {len(rows)} steps, {sum(r['kind'] == 'anchor' for r in rows)} anchors, "
          f"{_human(total)}")
    if rows:
        print(f"{'step':>10} {'kind':<6} {'base':>10} {'anchor':>10} {'files':>5} {'bytes':>10} "
              f"{'changed':>12} {'sparsity':>9}")
    for r in rows:
        base = "-" if r["base_step"] is None else r["base_step"]
        print(f"{r['step']:>10} {r['kind']:<6} {base:>10} {r['anchor_step']:>10} {r['files']:>5} "
              f"{_human(r['bytes']):>10} {r['changed']:>12} {r['sparsity'] * 100:>8.3f}%")
    writers = sorted({(r["writer"], r["run_id"]) for r in rows if r["writer"]})
    for writer, run_id in writers:
        steps = [r["step"] for r in rows if r["writer"] == writer]
        print(f"writer {writer} (run {run_id}): steps {steps[0]}..{steps[-1]} ({len(steps)})")
    if any(r["format_version"] == 1 for r in rows):
        print(f"format v1 (anonymous writer): {sum(r['format_version'] == 1 for r in rows)} steps")
    for c in chains:
        state = "complete" if c["complete"] else "BROKEN"
        print(f"chain from anchor {c['anchor']}: steps {c['first']}..{c['last']} ({c['steps']}), {state}")
    for problem in problems:
        print(f"problem: {problem}")
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# ---------------------------------------------------------------------------- verify
def add_verify(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "verify", help="check every manifest, file (size, sha256), chunk (sha256, coverage), chain "
        "and fingerprint"
    )
    p.add_argument("url")
    p.set_defaults(func=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    check_source(args.url)

    async def go() -> tuple[list[int], list[str]]:
        async with BucketReader.open(args.url) as reader:
            return await reader.list_steps(), await reader.verify()

    steps, problems = asyncio.run(go())
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} problem(s) in {redact_url(args.url)}", file=sys.stderr)
        return 1
    print(f"ok: {len(steps)} steps verified in {redact_url(args.url)}")
    return 0


# ---------------------------------------------------------------------------- materialize
def add_materialize(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "materialize", help="write the full bf16 checkpoint of one step (model.safetensors)"
    )
    p.add_argument("url")
    p.add_argument("--step", type=int, default=None, help="step to rebuild (default: newest)")
    p.add_argument("--out", required=True, help="directory to write model.safetensors into")
    p.add_argument("--force", action="store_true", help="replace an existing model.safetensors")
    p.set_defaults(func=_run_materialize)


def _run_materialize(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    out = Path(args.out) / "model.safetensors"
    if out.exists() and not args.force:
        print(f"vllm-deltasync materialize: {out} exists; pass --force to replace it", file=sys.stderr)
        return 1

    def warn(line: str) -> None:
        print(f"vllm-deltasync materialize: warning: {line}", file=sys.stderr)

    async def go() -> tuple[int, Manifest, dict[str, Any]]:
        async with BucketReader.open(args.url) as reader:
            step = args.step
            if step is None:  # the newest readable: a garbage newest manifest is skipped
                newest = await newest_readable(reader, warn=warn)
                if newest is None:
                    raise DeltaSyncError(f"{redact_url(args.url)} holds no committed step")
                step = newest[0]
            chain = await reader.plan(None, step)
            await check_anchor_files(reader.store, chain[0])  # before allocating what it claims
            tensors = await reader.read_full(step)  # verifies every file before decoding it
            return step, await reader.manifest(step), tensors

    step, manifest, tensors = asyncio.run(go())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    meta = {"format": "pt", "vllm_deltasync_step": str(step), "vllm_deltasync_fingerprint": manifest.fingerprint}
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {out}: step {step}, {len(tensors)} tensors")
    return 0


async def check_anchor_files(store: Store, anchor: Manifest, *, concurrency: int = 16) -> None:
    """Refuse an anchor whose data files cannot hold what it claims, before anything is sized
    by its claims: every file must exist with the size its manifest records (``store.stat``),
    and together they must hold 2 bytes (one bf16) per element of its tensors, as a dense
    anchor does. FormatError / IntegrityError naming the step and the fix."""
    slots = asyncio.Semaphore(concurrency)

    async def size(path: str) -> int | None:
        async with slots:
            info = await store.stat(path)
            return None if info is None else info.size

    total = 0
    for entry, actual in zip(anchor.files, await asyncio.gather(*(size(f.path) for f in anchor.files)),
                             strict=True):
        if actual is None:
            raise IntegrityError(f"step {anchor.step}: data file {entry.path} listed in its "
                                 f"manifest is missing from {store.url}; materialize another step")
        if actual != entry.size:
            raise IntegrityError(f"step {anchor.step}: data file {entry.path} is {actual} bytes, "
                                 f"its manifest says {entry.size}; the file or manifest is corrupt")
        total += actual
    elements = sum(t.numel for t in anchor.tensors)
    if total < 2 * elements:
        raise FormatError(
            f"step {anchor.step} of {store.url}: anchor claims {elements} bf16 elements "
            f"({_human(2 * elements)}) but its {len(anchor.files)} data files hold "
            f"{_human(total)}; the manifest is corrupt or hostile, nothing was allocated. "
            "Materialize another step")


__all__ = ["add_inspect", "add_materialize", "add_verify", "check_anchor_files", "check_source"]

"""The speculative drafter follows its own bucket beside the policy (issue 26, first part).

A real engine serves an 2-layer Llama policy with speculative decoding by a separate 1-layer
Llama draft model (``method="draft_model"``, same tokenizer). The policy's trainer publishes
to one bucket and the draft's trainer to another (``VLLM_DELTASYNC_DRAFTER_URL``); both take
real AdamW steps. After each step the engine switched both by itself, and:

* the drafter's live weights equal its trainer's checkpoint of that step bit for bit (per rank
  digests, ``deltasync_weight_digests(model="drafter")``);
* greedy tokens equal those of a fresh engine with the same speculative configuration started
  from the two checkpoints of that step (speculative decoding never changes greedy tokens;
  the same kernels on both sides);
* vLLM's acceptance counters are present and count.

Then the drafter's bucket breaks (its newest step's data files are corrupt at TP=1, gone at
TP=2): the policy keeps following, the drafter keeps its last good weights, ``/synced`` shows
the drafter's error without answering 503 for it (a draft changes speed, never tokens), and the
metrics say so (``deltasync_failing{model="drafter"} 1``, its applied step unchanged).

An EAGLE head (``method="eagle"``) trained beside the policy is published in the policy's own
bucket under ``drafter_prefix`` and followed from there (issue 26, item 3).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_eagle_head, build_model
from tests.helpers.cores import engine_cores
from tests.helpers.drafter import greedy, speculative_llm
from tests.helpers.engines import (
    Trainer,
    close_llm,
    engine_env,
    engine_status,
    requires_vllm,
    run_engine_child,
    wait_applied,
)
from tests.helpers.net import free_port
from vllm_deltasync import DeltaPublisher

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "dashboards" / "vllm-deltasync.json"

STEPS = 2


FRESH = """
import json, sys
from pathlib import Path
from tests.helpers.drafter import greedy, speculative_llm
from tests.helpers.engines import close_llm
out = {}
tp, method = int(sys.argv[2]), sys.argv[3]
for policy, draft in json.loads(sys.argv[1]):
    llm = speculative_llm(Path(policy), Path(draft), extension=False, tp=tp, method=method)
    try:
        out[policy] = greedy(llm)
    finally:
        close_llm(llm)
print("FRESH " + json.dumps(out))
"""


def _fresh(tmp: Path, pairs: list[tuple[Path, Path]], tp: int,
           method: str = "draft_model") -> dict[str, list[list[int]]]:
    """Greedy tokens of fresh stock engines (no extension, same speculative configuration),
    one per (policy, draft) checkpoint pair, in a child process."""
    env = {"VLLM_CACHE_ROOT": str(tmp / "fresh-cache"), "VLLM_CPU_OMP_THREADS_BIND": engine_cores(tp)}
    proc = run_engine_child(tmp, FRESH, json.dumps([[str(p), str(d)] for p, d in pairs]),
                            str(tp), method, env=env, timeout=300,
                            hang="the fresh speculative engine hung")
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("FRESH ")]
    return json.loads(line[len("FRESH "):])


def _drafter_digests_equal(llm: Any, ckpt: Path) -> bool:
    live = llm.collective_rpc("deltasync_weight_digests", kwargs={"model": "drafter"})
    want = llm.collective_rpc("deltasync_checkpoint_digests", args=(str(ckpt),),
                              kwargs={"model": "drafter"})
    return bool(live) and all(live) and live == want


def _wait_drafter(llm: Any, step: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        drafters = [s.get("drafter") or {} for s in llm.collective_rpc("deltasync_status")]
        if all(d.get("applied_step") == step for d in drafters):
            return drafters
        if time.monotonic() > deadline:
            raise AssertionError(f"drafter step {step} not applied after {timeout_s}s: "
                                 f"{drafters}")
        llm.generate(["tick"], use_tqdm=False)  # the in-process engine ticks on calls
        time.sleep(0.1)


def _release(bucket: Path, live: Path) -> None:
    """Copy the steps the draft's trainer committed in ``bucket`` into ``live``, the bucket the
    engine follows: data files first, each manifest last, every object under a ``.tmp-`` name
    (which readers ignore) and renamed into place. The test can so break a step's data before
    any reader may see that step: corrupting a committed step in place races the engine's
    poller, which may already have downloaded the good bytes."""
    files = sorted((f for f in bucket.rglob("*") if f.is_file()),
                   key=lambda f: f.relative_to(bucket).parts[0] == "manifests")
    for f in files:
        dst = live / f.relative_to(bucket)
        if dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(".tmp-" + dst.name)
        shutil.copyfile(f, tmp)
        os.replace(tmp, dst)


def _spec_counters(llm: Any) -> dict[str, float]:
    """vLLM's own speculative-decoding counters (the acceptance rate is accepted / draft)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
    return out


@requires_vllm
@pytest.mark.engine
@pytest.mark.usefixtures("host_runs_draft_model")  # skips where a stock one dies of SIGILL
@pytest.mark.parametrize("tp", [1, 2])
def test_policy_and_drafter_follow_their_buckets(tmp_path: Path, tp: int) -> None:
    policy_dir = build_model(tmp_path / "policy", "llama", seed=3)
    draft_dir = build_model(tmp_path / "draft", "llama", num_layers=1, seed=3)
    policy, draft = Trainer(policy_dir, lr=2e-3, seed=1), Trainer(draft_dir, lr=2e-3, seed=2)
    p_url, d_url = f"file://{tmp_path}/policy-bucket", f"file://{tmp_path}/draft-bucket"
    draft_bucket, draft_live = tmp_path / "draft-bucket", tmp_path / "draft-live"
    draft_live.mkdir()
    port = free_port()
    ckpts: list[tuple[Path, Path]] = []
    with DeltaPublisher(p_url, anchor_every=10) as ppub, \
            DeltaPublisher(d_url, anchor_every=10) as dpub, \
            engine_env(tmp_path, tp, url=p_url, drafter_url=f"file://{draft_live}",
                       poll_interval_s=0.1,
                       metrics_port=port, metrics_host="127.0.0.1"):
        llm = speculative_llm(policy_dir, draft_dir, extension=True, tp=tp)
        try:
            for step in range(STEPS + 1):
                if step:
                    policy.step()
                    draft.step()
                ppub.publish(step, policy.named_tensors())
                dpub.publish(step, draft.named_tensors())
                ppub.flush()
                dpub.flush()
                _release(draft_bucket, draft_live)
                ckpts.append((policy.save(tmp_path / f"p{step}"), draft.save(tmp_path / f"d{step}")))
                _wait_drafter(llm, step)
                wait_applied(llm, step)
                assert _drafter_digests_equal(llm, ckpts[-1][1]), step
                assert not _drafter_digests_equal(llm, draft_dir) or step == 0
                got = greedy(llm)
                if step == STEPS:
                    served = got
            counters = _spec_counters(llm)
            assert counters.get("vllm:spec_decode_num_draft_tokens", 0) > 0, counters
            assert "vllm:spec_decode_num_accepted_tokens" in counters, counters
            # the dashboard's acceptance panel reads exactly these counters
            panel = set(re.findall(r"vllm:[a-z_]+", DASHBOARD.read_text()))
            assert panel and {n.removesuffix("_total") for n in panel} <= set(counters), panel
            status = engine_status(llm)["drafter"]
            assert [s["step"] for s in status["switches"]] == list(range(STEPS + 1)), status

            # the drafter's bucket breaks: its newest step's data is corrupt (TP=1) or gone (TP=2)
            policy.step()
            draft.step()
            dpub.publish(STEPS + 1, draft.named_tensors())
            dpub.flush()
            broken = [f for d in (draft_bucket / "data").glob(f"{STEPS + 1:012d}-*")
                      for f in d.iterdir()]
            assert broken
            for f in broken:
                if tp == 1:
                    data = bytearray(f.read_bytes())
                    data[len(data) // 2] ^= 0xFF
                    f.write_bytes(bytes(data))
                else:
                    f.unlink()
            _release(draft_bucket, draft_live)
            ppub.publish(STEPS + 1, policy.named_tensors())
            ppub.flush()
            wait_applied(llm, STEPS + 1)
            deadline = time.monotonic() + 30
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/synced", timeout=5) as r:
                        synced = json.loads(r.read())
                except urllib.error.HTTPError as err:
                    synced = json.loads(err.read())
                drafter_rows = synced.get("drafter") or []
                if (drafter_rows and all(row["last_error"] for row in drafter_rows)
                        and synced["synced"]):
                    break
                assert time.monotonic() < deadline, synced
                llm.generate(["tick"], use_tqdm=False)
                time.sleep(0.2)
            assert synced["synced"] is True and synced["drafter_synced"] is False, synced
            assert all(row["applied_step"] == STEPS for row in drafter_rows), synced
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            for rank in range(tp):
                who = f'model="drafter",rank="{rank}"'
                assert f"deltasync_failing{{{who}}} 1.0" in text, text
                assert f"deltasync_applied_step{{{who}}} {float(STEPS)}" in text, text
                assert f'deltasync_failing{{model="policy",rank="{rank}"}} 0.0' in text, text
            reason = "IntegrityError" if tp == 1 else ""
            assert re.search(r'deltasync_failures_total\{model="drafter",rank="0",'
                             rf'reason="\w*{reason}\w*",stage="\w+"\}} [1-9]', text), text
            assert _drafter_digests_equal(llm, ckpts[-1][1])  # its last good weights
        finally:
            close_llm(llm)
    fresh = _fresh(tmp_path, [ckpts[-1]], tp)
    assert served == fresh[str(ckpts[-1][0])]


def _nudge(tensors: dict[str, Any], seed: int) -> None:
    """A training-like step on the EAGLE head: ~2% of each tensor's elements move by a few
    bf16 ulps (in place). The head is trained against the target's hidden states, which this
    test does not reproduce; what it checks is that the drafter follows whatever is published."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for t in tensors.values():
        bits = t.view(torch.int16).reshape(-1)
        mask = torch.rand(bits.numel(), generator=gen) < 0.02
        bits[mask] += torch.randint(1, 4, (int(mask.sum()),), generator=gen, dtype=torch.int16)


@requires_vllm
@pytest.mark.engine
def test_an_eagle_head_in_the_policy_bucket_follows(tmp_path: Path) -> None:
    """``method="eagle"`` with the head trained beside the policy and published in the same
    ``publish`` call, under ``drafter_prefix`` (``eagle.fc.weight``...). The head (``fc``, one
    decoder layer; vLLM shares the policy's embedding and lm_head modules with it) follows the
    policy's bucket: its map covers the head's own tensors (the shared modules stay the
    policy's), its proof's forward sees every class it writes (``fc`` is a replicated linear),
    its digests equal each published head, the policy's equal the policy's checkpoint, and
    greedy tokens equal a fresh engine with the same head."""
    from safetensors.torch import load_file, save_file

    policy_dir = build_model(tmp_path / "policy", "llama", seed=4)
    head_dir = build_eagle_head(tmp_path / "head", policy_dir, seed=4)
    policy = Trainer(policy_dir, lr=2e-3, seed=1)
    head = load_file(str(head_dir / "model.safetensors"))
    url = f"file://{tmp_path}/bucket"
    ckpts: list[tuple[Path, Path]] = []
    with DeltaPublisher(url, anchor_every=10) as pub, \
            engine_env(tmp_path, 1, url=url, drafter_prefix="eagle.", poll_interval_s=0.1,
                       metrics_port=0):
        pub.publish(0, [*policy.named_tensors(), *((f"eagle.{n}", t) for n, t in head.items())])
        pub.flush()
        llm = speculative_llm(policy_dir, head_dir, extension=True, method="eagle")
        try:
            [status] = llm.collective_rpc("deltasync_status")
            assert status["refused"] is None and status["drafter"]["refused"] is None, status
            proof = status["drafter"]["proof"]["classes"]
            assert "model.fc.weight" in proof, proof
            assert all(c["write_check"] == "changed outputs" for c in proof.values()
                       if c["informative"]), proof
            [live] = llm.collective_rpc("deltasync_weight_digests", kwargs={"model": "drafter"})
            assert sorted(live) == sorted(head), live  # the head's own tensors, nothing shared
            for step in range(STEPS + 1):
                if step:
                    policy.step()
                    _nudge(head, seed=step)
                    pub.publish(step, [*policy.named_tensors(),
                                       *((f"eagle.{n}", t) for n, t in head.items())])
                    pub.flush()
                step_head = tmp_path / f"h{step}"
                step_head.mkdir()
                (step_head / "config.json").write_text((head_dir / "config.json").read_text())
                save_file(dict(head), str(step_head / "model.safetensors"))
                ckpts.append((policy.save(tmp_path / f"p{step}"), step_head))
                _wait_drafter(llm, step)
                wait_applied(llm, step)
                assert _drafter_digests_equal(llm, step_head), step
                # the shared embedding and lm_head hold the policy's step, nothing else
                assert llm.collective_rpc("deltasync_weight_digests") == llm.collective_rpc(
                    "deltasync_checkpoint_digests", args=(str(ckpts[-1][0]),)), step
                served = greedy(llm)
            assert _spec_counters(llm).get("vllm:spec_decode_num_draft_tokens", 0) > 0
            switched = engine_status(llm)["drafter"]["switches"]
            assert [s["step"] for s in switched] == list(range(STEPS + 1)), switched
        finally:
            close_llm(llm)
    fresh = _fresh(tmp_path, [ckpts[-1]], 1, method="eagle")
    assert served == fresh[str(ckpts[-1][0])]

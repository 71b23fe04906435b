"""LoRA adapters followed from buckets, served by vLLM's API server (issue 35, items 3 and 4).

A PEFT LoRA (rank 8 on every linear layer of the toy Llama) trained with AdamW is published
with ``DeltaPublisher(url, lora="adapter")``, one step at a time, into the bucket a real API
server follows (``VLLM_DELTASYNC_LORA_URLS``; ``--enable-lora``). After every step:

- ``model="<name>"`` gives the greedy tokens and prompt logprobs a fresh ``--enable-lora``
  engine gives for that step's adapter as a PEFT directory (``materialize_adapter``) through
  vLLM's own ``LoRARequest`` (one reference engine serves every step's directory), and
  ``X-Weight-Version`` / ``weight_versions`` say the adapter's step;
- ``model="<name>@<step>"`` answers from exactly that step while it is kept
  (``lora_versions_kept`` = 2) and 404 naming the kept ones after;
- ``/v1/models`` lists ``<name>`` and each kept ``<name>@<step>``.

A request running across a switch finishes on the version it started on (switches are placed
inside it with the test-only ``switch_every_steps``), and the long prompt's prefix-cache
blocks never serve another version (the prompt logprobs of each version equal its reference).
One TP=1 server follows three adapters from three buckets; one TP=2 server follows the adapter
beside three it refuses (rank above ``--max-lora-rank``, modules the model lacks, another base
model), serving the base model and the good adapter meanwhile.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from examples.toymodel import build_model, load_hf_model
from tests.helpers.cores import engine_cores
from tests.helpers.engine_hooks import switch_every_steps_env
from tests.helpers.engines import (
    EXTENSION,
    ApiServer,
    api_server,
    close_llm,
    engine_env,
    get_json,
    requires_vllm,
)
from tests.helpers.lora_serving import (
    LORA_PROMPTS,
    AdapterSource,
    lora_complete,
    lora_references,
    served_models,
    train_adapter,
    wait_models,
)
from tests.helpers.net import free_port
from vllm_deltasync import DeltaPublisher

STEPS = 6
"""Steps 0..6 of the main adapter: 0..5 followed one by one, 6 switched inside a request."""
EVERY = 3
"""Model steps between switch ticks (``switch_every_steps``)."""


@dataclass
class LoraRun:
    tmp: Path
    model_dir: Path
    policy_url: str
    main: AdapterSource
    second: AdapterSource
    third: AdapterSource
    refs: dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, host_runs_lora: None) -> LoraRun:
    tmp = tmp_path_factory.mktemp("lora")
    model_dir = build_model(tmp / "model", "llama", seed=21)
    policy_url = f"file://{tmp}/policy"
    with DeltaPublisher(policy_url) as pub:  # the base model's bucket: step 0, never changes
        pub.publish(0, [(n, p.detach()) for n, p in load_hf_model(model_dir).named_parameters()])
        pub.flush()
    main = train_adapter(model_dir, tmp, "main", steps=STEPS, seed=1)
    second = train_adapter(model_dir, tmp, "second", steps=1, seed=2)
    third = train_adapter(model_dir, tmp, "third", steps=2, rank=4, seed=3,
                          targets=("q_proj", "v_proj"))
    dirs = {main.label(s): d for s, d in main.dirs.items()}
    dirs.update({second.label(1): second.dirs[1], third.label(2): third.dirs[2]})
    refs = lora_references(tmp, 1, model_dir, dirs, max_rank=8)
    return LoraRun(tmp, model_dir, policy_url, main, second, third, refs)


def _metric(metrics: str, name: str, model: str) -> list[float]:
    with urllib.request.urlopen(metrics + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith(name + "{") and f'model="{model}"' in ln]


def _check_step(api: str, model: str, ref: list[dict[str, Any]], step: int, *,
                prompts: int = len(LORA_PROMPTS)) -> None:
    """The first ``prompts`` prompts through ``model`` equal the reference of ``step`` and
    are labelled ``step``."""
    for prompt, want in zip(LORA_PROMPTS[:prompts], ref[:prompts], strict=True):
        status, got, headers = lora_complete(api, model, prompt)
        assert status == 200, got
        assert got["tokens"] == want["tokens"], (model, step)
        assert got["prompt_logprobs"] == want["prompt_logprobs"], (model, step)
        assert headers["X-Weight-Version"] == str(step)
        assert {s["version"] for s in got["weight_versions"]} == {str(step)}, got


def _wait_staged(metrics: str, model: str, step: int, server: ApiServer) -> None:
    deadline = time.monotonic() + 120
    while _metric(metrics, "deltasync_staged_step", model) != [float(step)]:
        if time.monotonic() > deadline or server.proc.poll() is not None:
            pytest.fail(f"{model} step {step} never staged:\n" + server.log_tail())
        time.sleep(0.1)


@pytest.fixture
def tp1_server(lora_run: LoraRun) -> Iterator[tuple[ApiServer, str]]:
    run = lora_run
    for src in (run.second, run.third):  # published before the server starts
        src.release(*src.steps)
    port = free_port()
    (run.tmp / "tp1").mkdir(exist_ok=True)
    env = {"VLLM_DELTASYNC_URL": run.policy_url, "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.2",
           "VLLM_DELTASYNC_METRICS_PORT": str(port), "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1",
           "VLLM_DELTASYNC_LORA_URLS": json.dumps({s.name: s.url for s in
                                                    (run.main, run.second, run.third)}),
           **switch_every_steps_env(EVERY)}
    with api_server(run.tmp / "tp1", run.model_dir, env,
                    extra_args=("--enable-lora", "--max-lora-rank", "8", "--max-cpu-loras", "6",
                                "--max-loras", "2")) as server:
        yield server, f"http://127.0.0.1:{port}"


@requires_vllm
@pytest.mark.engine
def test_tp1_server_follows_three_adapters(lora_run: LoraRun,
                                           tp1_server: tuple[ApiServer, str]) -> None:
    run, (server, metrics) = lora_run, tp1_server
    api, main = server.url, run.main
    base = str(run.model_dir)

    def nudge() -> None:  # model steps, so that the engine's switch ticks run
        lora_complete(api, base, LORA_PROMPTS[0], tokens=EVERY + 1)

    wait_models(api, {"second@1", "third@2"}, server, nudge=nudge)
    _check_step(api, "second", run.refs["second@1"], 1)
    _check_step(api, "third@2", run.refs["third@2"], 2)
    for step in range(STEPS):
        main.release(step)
        gone = frozenset({main.label(step - 2)}) if step >= 2 else frozenset()
        listed = wait_models(api, {main.label(step)}, server, gone=gone, nudge=nudge)
        assert {"main", "second", "third", base} <= listed
        _check_step(api, "main", run.refs[main.label(step)], step)
        if step >= 1:  # the version before is kept (lora_versions_kept=2)
            assert main.label(step - 1) in listed
            _check_step(api, main.label(step - 1), run.refs[main.label(step - 1)], step - 1)
        if step >= 2:  # the one before that is not: 404 naming the kept ones
            status, body, _ = lora_complete(api, main.label(step - 2), LORA_PROMPTS[0])
            assert status == 404, body
            message = body["error"]["message"]
            assert main.label(step - 1) in message and main.label(step) in message, message
    # unknown names stay vLLM's own 404
    status, body, _ = lora_complete(api, "nosuch", LORA_PROMPTS[0])
    assert status == 404 and "nosuch" in body["error"]["message"], body
    status, body, _ = lora_complete(api, "main@999", LORA_PROMPTS[0])
    assert status == 404 and "main@5" in body["error"]["message"], body

    # a request across a switch: step 6 staged, switched a few model steps into the request
    last = STEPS - 1
    main.release(STEPS)
    _wait_staged(metrics, "main", STEPS, server)
    assert main.label(STEPS) not in served_models(api)
    _check_step(api, "main", run.refs[main.label(last)], last, prompts=1)
    wait_models(api, {main.label(STEPS)}, server, gone=frozenset({main.label(last - 1)}))
    _check_step(api, "main", run.refs[main.label(STEPS)], STEPS)
    assert _metric(metrics, "deltasync_applied_step", "main") == [float(STEPS)]
    assert _metric(metrics, "deltasync_failing", "main") == [0.0]
    assert _metric(metrics, "deltasync_applied_step", "third") == [2.0]
    # the headers apply to the adapter the request names
    status, body, headers = lora_complete(api, "main", LORA_PROMPTS[0],
                                          headers={"X-Exact-Weight-Version": str(last)})
    assert status == 200 and headers["X-Weight-Version"] == str(last), body
    status, body, headers = lora_complete(api, "main", LORA_PROMPTS[0],
                                          headers={"X-Exact-Weight-Version": str(last - 1)})
    assert status == 409 and body["error"]["reason"] == "exact_passed", body
    status, body, _ = lora_complete(api, "second", LORA_PROMPTS[0],
                                    headers={"X-Min-Weight-Version": "1"})
    assert status == 200, body
    code, synced = get_json(metrics + "/synced?model=main")
    assert code == 200 and synced["synced"], synced


def _gpt2_model(out: Path) -> Path:
    """A tiny GPT-2 checkpoint: its attention is ``c_attn``, a module a Llama has no LoRA
    layer for."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=100, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(out)
    return out


@requires_vllm
@pytest.mark.engine
def test_tp2_server_follows_and_refuses_bad_adapters(lora_run: LoraRun) -> None:
    """TP=2: the adapter follows every step (a reference engine at TP=2: vLLM's TP LoRA layers
    slice the full tensors per rank); beside it, three adapters are refused, each with one line
    naming it and the fix (``/synced?model=<name>`` 503, ``deltasync_failing`` 1, 503 to a
    request naming it), while the base model and the good adapter serve."""
    run = lora_run
    tmp = run.tmp / "tp2"
    tmp.mkdir()
    main = AdapterSource("main", run.main.source, tmp / "main-live", run.main.dirs)
    refs = lora_references(tmp, 2, run.model_dir,
                           {main.label(s): main.dirs[s] for s in (0, 3, 5)}, max_rank=8)
    wide = train_adapter(run.model_dir, tmp, "wide", steps=0, rank=16, seed=4)
    alien = train_adapter(_gpt2_model(tmp / "gpt2"), tmp, "alien", steps=0, seed=5,
                          targets=("c_attn",))
    other = train_adapter(build_model(tmp / "other-model", "llama", hidden_size=64, num_heads=2,
                                      num_kv_heads=1, seed=6), tmp, "other", steps=0, seed=6)
    for bad in (wide, alien, other):
        bad.release(0)
    port = free_port()
    env = {"VLLM_DELTASYNC_URL": run.policy_url, "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.2",
           "VLLM_DELTASYNC_METRICS_PORT": str(port), "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1",
           "VLLM_DELTASYNC_LORA_URLS": json.dumps({s.name: s.url for s in
                                                    (main, wide, alien, other)}),
           "VLLM_CPU_OMP_THREADS_BIND": engine_cores(2)}
    metrics = f"http://127.0.0.1:{port}"
    with api_server(tmp, run.model_dir, env,
                    extra_args=("--tensor-parallel-size", "2", "--enable-lora",
                                "--max-lora-rank", "8", "--max-cpu-loras", "8")) as server:
        api = server.url
        for step in range(6):
            main.release(step)
            wait_models(api, {main.label(step)}, server)
            if step in (0, 3, 5):
                _check_step(api, "main", refs[main.label(step)], step)
        fixes = {"wide": "--max-lora-rank 16", "alien": "no LoRA layer for",
                 "other": "another base model"}
        for name, fix in fixes.items():
            code, body = get_json(metrics + f"/synced?model={name}")
            assert code == 503 and not body["synced"], body
            reasons = [r["refused"] for r in body["ranks"]]
            assert len(reasons) == 2 and all(f"adapter {name!r}" in r and fix in r
                                             for r in reasons), reasons
            assert _metric(metrics, "deltasync_failing", name) == [1.0, 1.0]
            status, answer, _ = lora_complete(api, name, LORA_PROMPTS[0])
            assert status == 503 and fix in answer["error"]["message"], answer
        code, body = get_json(metrics + "/synced?model=main")
        assert code == 200 and body["synced"], body
        code, body = get_json(metrics + "/synced")
        assert code == 200 and body["synced"] and body["wide_synced"] is False, body
        status, answer, headers = lora_complete(api, str(run.model_dir), LORA_PROMPTS[0])
        assert status == 200 and headers["X-Weight-Version"] == "0", answer
        _check_step(api, "main@5", refs[main.label(5)], 5)


@requires_vllm
@pytest.mark.engine
def test_dp2_server_follows_the_adapter_on_both_engines(lora_run: LoraRun) -> None:
    """Data parallel 2: each engine follows the adapter by itself (its own ranks, its own
    versions); the API reads both engines' versions and every request, whichever engine
    serves it (``X-data-parallel-rank``), equals the reference."""
    run = lora_run
    tmp = run.tmp / "dp2"
    tmp.mkdir()
    main = AdapterSource("main", run.main.source, tmp / "main-live", run.main.dirs)
    port = free_port(2)
    env = {"VLLM_DELTASYNC_URL": run.policy_url, "VLLM_DELTASYNC_POLL_INTERVAL_S": "0.2",
           "VLLM_DELTASYNC_METRICS_PORT": str(port), "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1",
           "VLLM_DELTASYNC_LORA_URLS": json.dumps({"main": main.url})}
    metrics = [f"http://127.0.0.1:{port + i}" for i in range(2)]
    with api_server(tmp, run.model_dir, env,
                    extra_args=("--data-parallel-size", "2", "--enable-lora",
                                "--max-lora-rank", "8", "--max-cpu-loras", "4")) as server:
        api = server.url
        for step in (0, 1, 2):
            main.release(step)
            wait_models(api, {main.label(step)}, server)
            deadline = time.monotonic() + 60
            while [_metric(m, "deltasync_applied_step", "main") for m in metrics] != [
                    [float(step)]] * 2:
                assert time.monotonic() < deadline, "not applied on both engines"
                time.sleep(0.1)
            for engine in (0, 1):
                for prompt, want in zip(LORA_PROMPTS, run.refs[main.label(step)], strict=True):
                    status, got, headers = lora_complete(
                        api, "main", prompt, headers={"X-data-parallel-rank": str(engine)})
                    assert status == 200 and headers["X-Weight-Version"] == str(step), got
                    assert got["tokens"] == want["tokens"], (engine, step)
                    assert got["prompt_logprobs"] == want["prompt_logprobs"], (engine, step)
        for engine in (0, 1):
            _, got, _ = lora_complete(api, main.label(1), LORA_PROMPTS[0],
                                      headers={"X-data-parallel-rank": str(engine)})
            assert got["tokens"] == run.refs[main.label(1)][0]["tokens"], engine


@requires_vllm
@pytest.mark.engine
def test_refusals_at_start_keep_the_base_model_serving(lora_run: LoraRun) -> None:
    """An adapter on an engine without ``--enable-lora``, and adapters that do not fit
    ``--max-cpu-loras``, are refused at start (one line naming the adapter and the fix); the
    base model follows its bucket and serves."""
    from vllm import LLM, SamplingParams

    run = lora_run
    tmp = run.tmp / "start"
    tmp.mkdir()
    lora_urls = json.dumps({"main": f"file://{tmp}/main", "more": f"file://{tmp}/more"})
    cases = ({}, "start vLLM with --enable-lora"), (
        {"enable_lora": True, "max_lora_rank": 8, "max_cpu_loras": 3},
        "lora_versions_kept x adapters = 2 x 2 = 4 versions; start vLLM with --max-cpu-loras 4")
    for kwargs, fix in cases:
        with engine_env(tmp, 1, url=run.policy_url, lora_urls=lora_urls, poll_interval_s=0.2):
            llm = LLM(model=str(run.model_dir), enforce_eager=True, max_model_len=512,
                      dtype="bfloat16", seed=0, max_num_seqs=4, worker_extension_cls=EXTENSION,
                      **kwargs)
            try:
                [status] = llm.collective_rpc("deltasync_status")
                for name in ("main", "more"):
                    assert fix in (status[name]["refused"] or ""), status[name]
                    assert f"adapter {name!r}" in status[name]["refused"]
                out = llm.generate(["the policy reward"], SamplingParams(max_tokens=4),
                                   use_tqdm=False)
                assert out[0].outputs[0].token_ids
                deadline = time.monotonic() + 60
                while llm.collective_rpc("deltasync_status")[0]["applied_step"] != 0:
                    assert time.monotonic() < deadline, "the base model never followed"
                    llm.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False)
            finally:
                close_llm(llm)

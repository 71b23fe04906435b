"""A bad deltasync configuration never hangs or kills the engine (issue 24, item 2).

A misspelt variable, as a new user types it (``VLLM_DELTASYNC_POLL_INTERVAL``), next to a valid
``VLLM_DELTASYNC_URL``: before, the engine core raised ``ConfigError`` inside its busy loop after
its start was reported, and the caller waited forever. Now the engine serves its loaded
checkpoint with the extension refused, and ``/synced`` answers 503 naming the variable. Both
ways a user starts vLLM are checked, each in a child process with a deadline (a hang fails the
test instead of the suite): the API server (``vllm serve``'s module entry point) and the
offline ``LLM``.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from examples.toymodel import build_model
from tests.helpers.engines import api_server, complete, get_json, requires_vllm, run_engine_child
from tests.helpers.net import free_port

BAD = {"VLLM_DELTASYNC_POLL_INTERVAL": "1"}  # poll_interval_s without its unit
SAYS = "VLLM_DELTASYNC_POLL_INTERVAL is not a deltasync option"


def _check_synced(port: int) -> None:
    code, body = get_json(f"http://127.0.0.1:{port}/synced")
    assert code == 503, body
    text = json.dumps(body)
    assert SAYS in text and "invalid deltasync configuration" in text


@requires_vllm
@pytest.mark.engine
def test_api_server_with_a_misspelt_variable_serves_and_says_why(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "model", "llama", seed=3)
    port = free_port()
    env = {"VLLM_DELTASYNC_URL": f"file://{tmp_path}/bucket", **BAD,
           "VLLM_DELTASYNC_METRICS_PORT": str(port), "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1"}
    with api_server(tmp_path, model_dir, env) as server:
        out = complete(server.url, str(model_dir))
        assert out["choices"][0]["text"] is not None
        _check_synced(port)
        log = server.log.read_text(errors="replace")
        assert SAYS in log and "Traceback" not in log, server.log_tail()


# Issue 36, rows S5 and S7: a value out of range in a known variable. Before, ``nan`` was
# accepted (the engine core's timer flooded its own input queue: /health and /synced answered,
# a completion never did) and ``none`` for an integer option raised TypeError in the worker
# (the server exited after 2.5 min). Now every process refuses with a ConfigError naming the
# variable: the server serves its checkpoint and /synced says why.
INVALID = {
    "S5": ("VLLM_DELTASYNC_POLL_INTERVAL_S", "nan"),
    "S7": ("VLLM_DELTASYNC_MAX_CHAIN", "none"),
}


@requires_vllm
@pytest.mark.engine
@pytest.mark.parametrize("row", sorted(INVALID))
def test_S5_S7_invalid_value_serves_the_checkpoint_and_says_why(tmp_path: Path, row: str) -> None:
    var, raw = INVALID[row]
    model_dir = build_model(tmp_path / "model", "llama", seed=5)
    port = free_port()
    env = {"VLLM_DELTASYNC_URL": f"file://{tmp_path}/bucket", var: raw,
           "VLLM_DELTASYNC_METRICS_PORT": str(port), "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1"}
    with api_server(tmp_path, model_dir, env) as server:
        out = complete(server.url, str(model_dir))  # answered (60 s timeout), not hung
        assert out["choices"][0]["text"] is not None
        code, body = get_json(f"http://127.0.0.1:{port}/synced")
        assert code == 503, body
        text = json.dumps(body)
        assert "invalid deltasync configuration" in text and f"{var}='{raw}'" in text, text
        assert server.proc.poll() is None  # still serving
        log = server.log.read_text(errors="replace")
        assert f"{var}='{raw}'" in log and "Traceback" not in log, server.log_tail()


OFFLINE = textwrap.dedent('''
    import sys, urllib.request, urllib.error, json
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=256, dtype="bfloat16",
              max_num_seqs=2, worker_extension_cls="vllm_deltasync.DeltaSyncExtension")
    out = llm.generate(["the policy reward"], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    print("TOKENS", list(out[0].outputs[0].token_ids))
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[2]}/synced", timeout=5)
        print("SYNCED 200")
    except urllib.error.HTTPError as exc:
        print("SYNCED", exc.code, json.dumps(json.loads(exc.read())))
    llm.llm_engine.engine_core.shutdown()
''')


@requires_vllm
@pytest.mark.engine
def test_offline_llm_with_a_misspelt_variable_serves_and_says_why(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "model", "llama", seed=4)
    port = free_port()
    env = {"VLLM_DELTASYNC_URL": f"file://{tmp_path}/bucket", **BAD,
           "VLLM_DELTASYNC_METRICS_PORT": str(port), "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1"}
    proc = run_engine_child(tmp_path, OFFLINE, str(model_dir), str(port), env=env, timeout=240,
                            hang="LLM(...) hung with a misspelt VLLM_DELTASYNC_* variable")
    lines = proc.stdout.splitlines()
    assert any(x.startswith("TOKENS [") for x in lines), proc.stdout
    [synced] = [x for x in lines if x.startswith("SYNCED")]
    assert synced.startswith("SYNCED 503") and SAYS in synced, synced

"""A vLLM that lacks a symbol the extension relies on: vLLM serves, the extension refuses
visibly (issue 24, item 2).

In one child process (with a deadline), with the surface check made to fail for one symbol
(failpoint ``surface_break``, as if that vLLM release had renamed it):

- a plain engine (no ``--worker-extension-cls``) starts, with the package installed and its
  ``vllm.general_plugins`` entry point loaded, and generates;
- an engine naming the extension starts and serves its loaded weights (the same tokens as the
  plain engine, greedy), ``/synced`` answers 503 naming the symbol and the vLLM version, for
  the engine and every rank (no rank was started: none applies a step).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from examples.toymodel import build_model
from tests.helpers.engines import requires_vllm, run_engine_child
from tests.helpers.net import free_port
from vllm_deltasync import failpoints

SYMBOL = "vllm.v1.engine.core:EngineCoreProc._handle_client_request"

CHILD = textwrap.dedent('''
    import json, sys, urllib.error, urllib.request
    from vllm import LLM, SamplingParams
    model, port = sys.argv[1], sys.argv[2]
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = ["the policy reward", "a rollout of"]
    out = {}
    for name, ext in (("plain", None), ("extension", "vllm_deltasync.DeltaSyncExtension")):
        kwargs = {"worker_extension_cls": ext} if ext else {}
        llm = LLM(model=model, enforce_eager=True, max_model_len=256, dtype="bfloat16",
                  max_num_seqs=2, **kwargs)
        got = llm.generate(prompts, params, use_tqdm=False)
        out[name] = [list(o.outputs[0].token_ids) for o in got]
        out[name + "_plugin_loaded"] = "vllm_deltasync.server.vllm.plugin" in sys.modules
        if ext:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/synced", timeout=5)
                out["synced"] = [200, None]
            except urllib.error.HTTPError as exc:
                out["synced"] = [exc.code, json.loads(exc.read())]
        llm.llm_engine.engine_core.shutdown()
        del llm
    print("RESULT " + json.dumps(out, default=str))
''')


@requires_vllm
@pytest.mark.engine
def test_a_missing_symbol_refuses_the_extension_and_vllm_serves(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "model", "llama", seed=5)
    port = free_port()
    env = {"VLLM_DELTASYNC_URL": f"file://{tmp_path}/bucket", **failpoints.env(failpoints.spec("surface_break", SYMBOL)),
           "VLLM_DELTASYNC_METRICS_PORT": str(port), "VLLM_DELTASYNC_METRICS_HOST": "127.0.0.1"}
    proc = run_engine_child(tmp_path, CHILD, str(model_dir), str(port), env=env, timeout=300,
                            hang="an engine hung with the surface check failing")
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    assert out["plain_plugin_loaded"] and out["extension_plugin_loaded"], out
    assert out["plain"] and all(out["plain"]), out  # the plain engine generated
    assert out["extension"] == out["plain"], out  # the loaded weights, served
    code, body = out["synced"]
    assert code == 503 and not body["synced"], body
    text = json.dumps(body)
    assert SYMBOL in text and "vLLM " in text and "docs/extension.md" in text, text
    assert body["ranks"] and all(SYMBOL in r["last_error"] and r["applied_step"] is None
                                 for r in body["ranks"]), body
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]

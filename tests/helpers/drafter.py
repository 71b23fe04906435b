"""A speculative engine (a policy and its draft) and its greedy tokens, for the drafter tests
and the child process that starts their fresh reference engines (``tests/engine/test_drafter.py``
runs it with ``python -c``: a test module is never imported by another process's code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers.engines import EXTENSION

SPEC_TOKENS = 3
PROMPTS = ["the policy moved a step", "river mountain city house garden window"]


def speculative_llm(policy: Path, draft: Path, *, extension: bool, tp: int = 1,
                    method: str = "draft_model") -> Any:
    """vLLM's ``LLM`` of ``policy`` drafted by ``draft`` (``method``: ``draft_model`` or
    ``eagle``), :data:`SPEC_TOKENS` a step; with the extension or stock."""
    from vllm import LLM

    kw: dict[str, Any] = {"worker_extension_cls": EXTENSION} if extension else {}
    return LLM(model=str(policy), enforce_eager=True, max_model_len=512, dtype="bfloat16",
               tensor_parallel_size=tp,
               seed=0, max_num_seqs=4, disable_log_stats=False,
               speculative_config={"method": method, "model": str(draft),
                                   "num_speculative_tokens": SPEC_TOKENS}, **kw)


def greedy(llm: Any) -> list[list[int]]:
    """16 greedy tokens (EOS ignored) for each of :data:`PROMPTS`."""
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]

"""Pipeline parallel: checkpoint tensors of layers another stage holds are not this rank's.

vLLM builds a pipeline stage with ``PPMissingLayer`` placeholders for the layers (and the
embeddings or head) other stages hold; their loaders write nothing. The shard map records those
names as not on this rank (never fetched, never written) instead of refusing, and still refuses
a name that resolves to no module or to a layer this stage holds but whose loader wrote nothing.
The engine test is tests/engine/test_pp.py.
"""

from __future__ import annotations

import torch

from vllm_deltasync.server.worker.placement import _missing_stage_layer, classify_unplaced


class PPMissingLayer(torch.nn.Identity):
    """Stands for vLLM's placeholder (matched by class name: no vLLM import here)."""


def _stage0() -> torch.nn.Module:
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(8, 4)
    model.model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4),
                                              PPMissingLayer(), PPMissingLayer()])
    model.model.norm = PPMissingLayer()
    model.lm_head = PPMissingLayer()
    return model


def test_names_under_a_placeholder_belong_to_another_stage() -> None:
    model = _stage0()
    assert _missing_stage_layer(model, "model.layers.2.self_attn.q_proj.weight") == "model.layers.2"
    assert _missing_stage_layer(model, "model.norm.weight") == "model.norm"
    assert _missing_stage_layer(model, "lm_head.weight") == "lm_head"
    assert _missing_stage_layer(model, "model.layers.1.weight") is None
    assert _missing_stage_layer(model, "model.layers.7.weight") is None  # no such module
    assert _missing_stage_layer(model, "transformer.h.2.weight") is None


def test_unplaced_names_of_other_stages_are_ignored_others_still_fail() -> None:
    model = _stage0()
    unplaced = {"model.layers.3.mlp.down_proj.weight": "load_weights wrote nothing for it",
                "lm_head.weight": "load_weights wrote nothing for it",
                "model.layers.1.bias_typo": "load_weights wrote nothing for it",
                "model.layers.9.weight": "load_weights wrote nothing for it"}
    ignored, covered, errors = classify_unplaced(unplaced, {}, {}, model)
    assert set(ignored) == {"model.layers.3.mlp.down_proj.weight", "lm_head.weight"}
    assert "another pipeline stage" in ignored["lm_head.weight"]
    assert not covered
    assert len(errors) == 2 and all("wrote nothing" in e for e in errors), errors

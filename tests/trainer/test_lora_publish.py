"""LoRA policies through a real DeltaPublisher and a file:// bucket: ``publish(step, peft_model)``
(merged weights under the base checkpoint's names) and ``DeltaPublisher(url, lora="adapter")``
(the adapter and its configuration, rebuilt by format/adapter.py as a PEFT directory that
``PeftModel.from_pretrained`` loads). Tiny Llama, real peft, AdamW; no mocks."""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.lora import VOCAB, LoraTrainer, bits, lora_model, tiny_llama

peft = pytest.importorskip("peft", reason="the LoRA tests need peft (the 'lora' extra)")

from safetensors.torch import load_file  # noqa: E402

from vllm_deltasync import BucketReader, DeltaPublisher, PublisherOptions  # noqa: E402
from vllm_deltasync.errors import ConfigError, FormatError, PublishError  # noqa: E402
from vllm_deltasync.format.adapter import (  # noqa: E402
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterInfo,
    materialize_adapter,
)
from vllm_deltasync.format.manifest import Manifest, fingerprint  # noqa: E402


def _read_full(url: str, step: int) -> dict[str, torch.Tensor]:
    async def go() -> dict[str, torch.Tensor]:
        async with BucketReader.open(url) as reader:
            return await reader.read_full(step)
    return asyncio.run(go())


def _manifests(url: str) -> dict[int, Manifest]:
    root = Path(url.removeprefix("file://")) / "manifests"
    return {int(p.stem): Manifest.from_json(p.read_bytes(), source=str(p)) for p in root.glob("*.json")}


def _outputs(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- merged mode
@pytest.mark.parametrize("variant", [{}, {"use_dora": True}, {"init_lora_weights": "pissa"}])
def test_publish_a_peft_model_writes_the_merged_weights_each_step(tmp_path: Path,
                                                                  variant: dict[str, Any]) -> None:
    model = lora_model(modules_to_save=["lm_head"], **variant)
    trainer = LoraTrainer(model)
    url = f"file://{tmp_path}/merged"
    expected = {}
    with DeltaPublisher(url, anchor_every=3) as pub:
        for step in range(6):
            trainer.step()
            pub.publish(step, model)
            expected[step] = copy.deepcopy(model).merge_and_unload()
    base_names = [n for n, _ in tiny_llama().named_parameters()]
    manifests = _manifests(url)
    assert [m.kind for _, m in sorted(manifests.items())] == ["anchor", "delta", "delta"] * 2
    assert all(m.adapter is None for m in manifests.values())
    for step in (0, 4, 5):  # the first anchor, a delta, the last step
        got = _read_full(url, step)
        assert sorted(got) == sorted(base_names)
        for name, param in expected[step].named_parameters():
            assert torch.equal(bits(got[name].view(param.shape)), bits(param.detach())), (step, name)
    changed = [n for m in manifests.values() if m.kind == "delta" for n in (t.name for t in m.tensors)]
    assert changed and all(any(k in n for k in ("q_proj", "v_proj", "down_proj", "lm_head"))
                           for n in changed)  # only adapted weights and modules_to_save move


def test_publish_of_a_plain_module_is_its_named_parameters(tmp_path: Path) -> None:
    model = tiny_llama()
    url_a, url_b = f"file://{tmp_path}/a", f"file://{tmp_path}/b"
    with DeltaPublisher(url_a) as a, DeltaPublisher(url_b) as b:
        a.publish(0, model)
        b.publish(0, model.named_parameters())
    ma, mb = _manifests(url_a)[0], _manifests(url_b)[0]
    assert ma.fingerprint == mb.fingerprint and ma.totals == mb.totals


def test_merged_mode_leaves_the_training_model_as_it_was(tmp_path: Path) -> None:
    model = lora_model(use_dora=True)
    trainer = LoraTrainer(model)
    trainer.step()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with DeltaPublisher(f"file://{tmp_path}/b") as pub:
        pub.publish(0, model)
    assert all(torch.equal(bits(before[n]), bits(t)) for n, t in model.state_dict().items())


# ---------------------------------------------------------------------------- adapter mode
@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_adapter_bucket_rebuilds_what_save_pretrained_writes(tmp_path: Path,
                                                             adapter_dtype: torch.dtype | None) -> None:
    model = lora_model(adapter_dtype=adapter_dtype, use_rslora=True, lora_alpha=16,
                       modules_to_save=["lm_head"])
    trainer = LoraTrainer(model)
    url = f"file://{tmp_path}/adapter"
    with DeltaPublisher(url, lora="adapter", anchor_every=4) as pub:
        for step in range(6):
            trainer.step()
            pub.publish(step, model)
            model.save_pretrained(tmp_path / f"saved-{step}")
    manifests = _manifests(url)
    assert [m.kind for _, m in sorted(manifests.items())] == ["anchor", "delta", "delta", "delta",
                                                              "anchor", "delta"]
    base_fp = fingerprint((n, p.shape, "bfloat16") for n, p in tiny_llama().named_parameters())
    for step in range(6):
        info = manifests[step].adapter
        assert info is not None and info.base_fingerprint == base_fp
        assert (info.rank, info.alpha, info.use_rslora, info.scaling) == (4, 16, True, 16 / 2)
        out = tmp_path / f"rebuilt-{step}"
        assert materialize_adapter(url, out, step=step) == step
        want = load_file(str(tmp_path / f"saved-{step}" / WEIGHTS_NAME))
        got = load_file(str(out / WEIGHTS_NAME))
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():  # the published values: bf16 of what PEFT saves
            assert torch.equal(bits(got[name]), bits(tensor.to(torch.bfloat16))), (step, name)
        want_config = json.loads((tmp_path / f"saved-{step}" / CONFIG_NAME).read_text())
        got_config = json.loads((out / CONFIG_NAME).read_text())
        assert _as_sets(got_config) == _as_sets(want_config)
    # loaded by peft onto a fresh base, the rebuilt adapter computes what the trained one does
    # (a float32 adapter was published in bf16: compared with the model rounded so)
    trained = model if adapter_dtype is not None else _rounded(copy.deepcopy(model))
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "rebuilt-5",
                                            autocast_adapter_dtype=adapter_dtype is None)
    assert torch.equal(_outputs(loaded), _outputs(trained))


def _as_sets(config: dict[str, Any]) -> dict[str, Any]:
    """PEFT writes its sets (target_modules) as lists in set order."""
    return {k: sorted(v) if k in ("target_modules", "modules_to_save") and isinstance(v, list) else v
            for k, v in config.items()}


def _rounded(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its trainable tensors rounded to bf16 and back (what a bucket carries)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return model


def test_a_new_rank_or_target_set_starts_a_new_anchor(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/adapter"
    with DeltaPublisher(url, lora="adapter", anchor_every=100, keep_anchors=10) as pub:
        model = lora_model(r=4)
        trainer = LoraTrainer(model)
        for step in range(2):
            trainer.step()
            pub.publish(step, model)
        model = lora_model(r=8, target_modules=["q_proj", "k_proj"])
        trainer = LoraTrainer(model)
        for step in range(2, 4):
            trainer.step()
            pub.publish(step, model)
        alpha_changed = lora_model(r=8, lora_alpha=4, target_modules=["q_proj", "k_proj"])
        alpha_changed.load_state_dict(model.state_dict())
        pub.publish(4, alpha_changed)
    manifests = _manifests(url)
    assert [manifests[s].kind for s in range(5)] == ["anchor", "delta", "anchor", "delta", "anchor"]
    assert [manifests[s].adapter.rank for s in range(5)] == [4, 4, 8, 8, 8]  # type: ignore[union-attr]
    assert manifests[4].adapter.alpha == 4  # type: ignore[union-attr]
    out = tmp_path / "rebuilt"
    materialize_adapter(url, out, step=3)
    assert {t.shape[0] for n, t in load_file(str(out / WEIGHTS_NAME)).items() if "lora_A" in n} == {8}


def test_adapter_mode_refuses_what_it_cannot_publish(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lora="):
        DeltaPublisher(f"file://{tmp_path}/x", lora="adapters")
    with pytest.raises(ConfigError, match="format_version"):
        DeltaPublisher(f"file://{tmp_path}/x", lora="adapter", format_version=1)
    with pytest.raises(ConfigError, match="format_version"):  # an options object, overridden
        DeltaPublisher(f"file://{tmp_path}/x", PublisherOptions(lora="adapter"), format_version=1)
    assert not (tmp_path / "x").exists()  # refused before the store was opened
    with DeltaPublisher(f"file://{tmp_path}/a", lora="adapter") as pub:
        with pytest.raises(PublishError, match="peft"):
            pub.publish(0, tiny_llama())
        with pytest.raises(PublishError, match="publish\\(step, peft_model\\)"):
            pub.publish(0, lora_model().named_parameters())
        with pytest.raises(PublishError, match="changes the base weights"):
            pub.publish(0, lora_model(init_lora_weights="pissa"))
        two = lora_model()
        two.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj"]))
        two.base_model.set_adapter(["default", "other"])
        with pytest.raises(PublishError, match="2 adapters are active"):
            pub.publish(0, two)
        pub.publish(0, lora_model())  # nothing was half-published before
    assert sorted(_manifests(f"file://{tmp_path}/a")) == [0]


def test_a_merged_bucket_is_no_adapter(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/merged"
    with DeltaPublisher(url) as pub:
        pub.publish(0, lora_model())
    with pytest.raises(FormatError, match="not an adapter bucket"):
        materialize_adapter(url, tmp_path / "out")


# ---------------------------------------------------------------------------- the record
def _record(**over: Any) -> dict[str, Any]:
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": False,
              "target_modules": ["v_proj", "q_proj"], "task_type": "CAUSAL_LM"}
    doc = AdapterInfo.from_config(config, "sha256:" + "a" * 64).to_dict()
    doc.update(over)
    return doc


def test_the_adapter_record_round_trips_and_refuses_defects() -> None:
    info = AdapterInfo.from_dict(_record())
    assert (info.rank, info.alpha, info.scaling, info.target_modules) == (8, 16, 2.0, ("q_proj", "v_proj"))
    assert AdapterInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    for over, words in (({"rank": 0}, "rank"), ({"scaling": 3.0}, "scaling"),
                        ({"peft_type": "IA3"}, "peft_type"), ({"target_modules": []}, "target_modules"),
                        ({"base_fingerprint": "x"}, "base_fingerprint"), ({"rank": 4, "scaling": 4.0}, "disagrees"),
                        ({"config": "{}"}, "config")):
        with pytest.raises(FormatError, match=words):
            AdapterInfo.from_dict(_record(**over))


def test_the_manifest_carries_the_record_and_old_documents_ignore_it(tmp_path: Path) -> None:
    model = lora_model()
    url = f"file://{tmp_path}/adapter"
    with DeltaPublisher(url, lora="adapter", format_version=2) as pub:
        pub.publish(0, model)
    path = tmp_path / "adapter" / "manifests" / "000000000000.json"
    doc = json.loads(path.read_bytes())
    assert doc["adapter"]["rank"] == 4 and doc["requires"] == "vllm-deltasync>=0.2.0"
    # a reader of this release checks the record where it parses the manifest
    doc["adapter"]["scaling"] = 1.0
    with pytest.raises(FormatError, match="scaling"):
        Manifest.from_json(json.dumps(doc).encode(), source="edited")
    # without the record the same document is a plain step (what a reader that predates the
    # field reads: unknown fields are ignored, docs/format.md §12)
    del doc["adapter"]
    plain = Manifest.from_json(json.dumps(doc).encode(), source="edited")
    assert plain.adapter is None and plain.tensors


def test_the_package_publishes_a_plain_module_without_importing_peft(tmp_path: Path) -> None:
    code = f"""
import sys
sys.modules["peft"] = None  # any import of peft fails
import torch
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.trainer.lora import merged_tensors
model = torch.nn.Linear(8, 4, dtype=torch.bfloat16)
assert [n for n, _ in merged_tensors(model)] == ["weight", "bias"]
with DeltaPublisher("file://{tmp_path}/bucket") as pub:
    pub.publish(0, model)
print("ok", pub.stats.steps)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", "1"]


def test_a_reader_of_the_base_model_refuses_an_adapter_bucket(tmp_path: Path) -> None:
    """What a server does with an adapter bucket it follows as its policy (a reader that
    ignores the record): the steps are of another parameter set."""
    from vllm_deltasync.errors import FingerprintError

    url = f"file://{tmp_path}/adapter"
    with DeltaPublisher(url, lora="adapter") as pub:
        pub.publish(0, lora_model())
    base_fp = fingerprint((n, p.shape, "bfloat16") for n, p in tiny_llama().named_parameters())

    async def plan() -> None:
        async with BucketReader.open(url, fingerprint=base_fp) as reader:
            await reader.plan(None, 0)

    with pytest.raises(FingerprintError, match="another parameter set"):
        asyncio.run(plan())

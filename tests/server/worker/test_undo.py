"""Taking a switch back: ``apply_patches(..., undo)`` then ``Undo.revert()`` restores every bit.

Runs on vLLM's own TP-sharded modules (rank 1 of TP=2), like test_translate.py: a switch that
another rank failed is reverted on this one, and a rank that fails half-way puts back what it
wrote. Anchors (dense absolute pieces) are not recorded, so their undo is incomplete.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tp_world import TPWorld, make_step, random_checkpoint, state_bits
from vllm_deltasync.errors import ApplyError
from vllm_deltasync.server.vllm.loaders import LOADER
from vllm_deltasync.server.worker.apply import Undo, apply_patches, prepare
from vllm_deltasync.server.worker.shardmap import Piece, ShardMap, translate_all


def _undoable(patches: list) -> list:
    """Everything but dense absolute (anchor-like) patches."""
    return [p for p in patches if p.relative or p.indices is not None]


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_bias", "llama_tied"])
def test_two_steps_are_taken_back_bit_for_bit(tp_world: TPWorld, kind: str) -> None:
    params = tp_world.model(kind).checkpoint_params()
    base = random_checkpoint(params, seed=3)
    live = tp_world.build(kind, 2, 1)
    live.load_weights(iter(base.items()))
    before = state_bits(live)
    shardmap = ShardMap.from_model(live, params, loader=LOADER)
    undo = Undo()
    full, written = base, 0
    for step in range(2):  # the same elements change in both steps: reverted newest first
        patches, full = make_step(full, step)
        written += apply_patches(prepare(translate_all(shardmap, _undoable(patches))), undo)
    assert written > 0 and undo.complete
    assert any(not torch.equal(b, before[n]) for n, b in state_bits(live).items())
    undo.revert()
    for name, bits in state_bits(live).items():
        assert torch.equal(bits, before[name]), f"{kind}: {name} not put back"
    assert not undo.entries


def test_a_failure_half_way_puts_back_what_was_written(tp_world: TPWorld) -> None:
    params = tp_world.model("qwen2_bias").checkpoint_params()
    live = tp_world.build("qwen2_bias", 2, 1)
    live.load_weights(iter(random_checkpoint(params, seed=4).items()))
    before = state_bits(live)
    patches, _ = make_step(dict(random_checkpoint(params, seed=4)), 1)
    pieces = prepare(translate_all(ShardMap.from_model(live, params, loader=LOADER), _undoable(patches)))
    assert len(pieces) > 3
    broken = pieces[2]
    bad = Piece(broken.param, torch.tensor([broken.param.numel() + 5]), broken.values[:1],
                relative=broken.relative)
    undo = Undo()
    with pytest.raises((IndexError, RuntimeError)):
        apply_patches([*pieces[:2], bad, *pieces[3:]], undo)
    assert len(undo.entries) == 2
    undo.revert()
    for name, bits in state_bits(live).items():
        assert torch.equal(bits, before[name]), name


def test_dense_absolute_pieces_make_the_undo_incomplete() -> None:
    param = torch.zeros(4, 6, dtype=torch.bfloat16)
    from vllm_deltasync.server.worker.shardmap import DenseView

    piece = Piece(param, None, torch.ones(4, 6, dtype=torch.bfloat16),
                  dense=DenseView(offset=0, sizes=(4, 6), strides=(6, 1)))
    undo = Undo()
    apply_patches([piece], undo)
    assert not undo.complete and bool((param == 1).all())
    with pytest.raises(ApplyError, match="cannot be taken back"):
        undo.revert()


def test_relative_pieces_wrap_modulo_2_16_and_are_taken_back() -> None:
    """Relative differences are bit-pattern arithmetic mod 2**16 (docs/codec.md): 0x7FFF + 1
    is 0x8000, -0x8000 - 1 is 0x7FFF; the undo subtracts them back exactly."""
    bits = torch.tensor([0x7FFF, -0x8000, 0, 5, -1, 123], dtype=torch.int16)
    param = torch.nn.Parameter(bits.clone().view(torch.bfloat16), requires_grad=False)
    diff = torch.tensor([1, -1, 3], dtype=torch.int16)
    undo = Undo()
    apply_patches([Piece(param, torch.tensor([0, 1, 4]), diff, relative=True)], undo)
    got = param.data.view(torch.int16).tolist()
    assert got == [-0x8000, 0x7FFF, 0, 5, 2, 123], got
    undo.revert()
    assert torch.equal(param.data.view(torch.int16), bits)

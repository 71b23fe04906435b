"""Staged pieces (``apply.compact`` / ``prepare``): int32 indices relative to a base, 16-bit
values, split per window of 2**31 flat indices, widened to int64 in bounded blocks at the switch.

The window (``limit``) and the scatter block are parameters, so splitting and blocking are
tested on small tensors; one test feeds indices beyond 2**31 without allocating a parameter
that large (``compact`` never touches the parameter's storage).
"""

from __future__ import annotations

import pytest
import torch

import vllm_deltasync.server.worker.apply as apply_mod
from tests.helpers.tp_world import TPWorld, make_step, random_checkpoint, state_bits
from vllm_deltasync.server.vllm.loaders import LOADER
from vllm_deltasync.server.worker.apply import (
    INDEX_SPAN,
    Undo,
    apply_patches,
    compact,
    merge_pieces,
    prepare,
    staged_nbytes,
)
from vllm_deltasync.server.worker.shardmap import Piece, ShardMap, translate_all


def _flat_of(piece: Piece) -> torch.Tensor:
    assert piece.indices is not None
    return piece.indices.to(torch.int64) + piece.base


def _random_pieces(param: torch.Tensor, seed: int, n_pieces: int = 6) -> list[Piece]:
    """Disjoint sparse pieces (int64, unsorted) over ``param``: relative and absolute."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(param.numel(), generator=gen)
    chosen = perm[: param.numel() // 3]
    out = []
    for k, idx in enumerate(torch.chunk(chosen, n_pieces)):
        if k % 2:
            values = torch.randint(-50, 50, (idx.numel(),), generator=gen, dtype=torch.int16)
            out.append(Piece(param, idx.clone(), values, relative=True))
        else:
            values = torch.randn(idx.numel(), generator=gen).to(param.dtype)
            out.append(Piece(param, idx.clone(), values))
    return out


def test_split_beyond_two_to_the_31_without_a_large_parameter() -> None:
    stand_in = torch.empty(0, dtype=torch.bfloat16)  # never indexed by compact
    flat = torch.tensor([2**33 + 5, 3, 2**31 + 1, 2**31 - 1, 0, 2**32 + 2**31 + 9, 2**31],
                        dtype=torch.int64)
    values = torch.arange(flat.numel(), dtype=torch.int16)
    pieces = compact([Piece(stand_in, flat, values, relative=True)])
    assert len(pieces) > 1
    seen: dict[int, int] = {}
    for p in pieces:
        assert p.indices is not None and p.indices.dtype == torch.int32
        assert p.span is not None and p.span <= INDEX_SPAN
        assert int(p.indices.min()) >= 0 and int(p.indices.max()) < p.span
        for i, v in zip(_flat_of(p).tolist(), p.values.tolist(), strict=True):
            seen[i] = v
    assert seen == dict(zip(flat.tolist(), values.tolist(), strict=True))


@pytest.mark.parametrize("limit", [7, 64, 1000, INDEX_SPAN])
def test_split_and_merge_keep_every_index_with_its_value(limit: int) -> None:
    param = torch.zeros(1000, dtype=torch.bfloat16)
    original = _random_pieces(param, seed=limit)
    pieces = merge_pieces(compact(original, limit=limit), limit=limit)
    if limit < 1000:
        assert len(pieces) > 2  # several windows per (relative / absolute)
    for relative in (False, True):
        want = {}
        for p in original:
            if p.relative == relative:
                want.update(zip(p.indices.tolist(), p.values.tolist(), strict=True))
        got = {}
        for p in pieces:
            if p.relative != relative:
                continue
            assert p.indices is not None and p.indices.dtype == torch.int32
            assert p.span is not None and p.span <= limit
            assert int(p.indices.min()) >= 0 and int(p.indices.max()) < p.span
            got.update(zip(_flat_of(p).tolist(), p.values.tolist(), strict=True))
        assert got == want


@pytest.mark.parametrize(("limit", "block"), [(5, 3), (100, 7), (INDEX_SPAN, 1 << 20)])
def test_scatter_and_undo_are_bit_exact_vs_int64(monkeypatch: pytest.MonkeyPatch, limit: int,
                                                 block: int) -> None:
    base = torch.randn(3000, dtype=torch.float32).to(torch.bfloat16)
    ref, live = base.clone(), base.clone()
    apply_patches(_random_pieces(ref, seed=1))  # int64, unprepared: the reference path
    monkeypatch.setattr(apply_mod, "SCATTER_BLOCK", block)
    staged = merge_pieces(prepare(_random_pieces(live, seed=1), limit=limit), limit=limit)
    assert all(p.indices is not None and p.indices.dtype == torch.int32 for p in staged)
    undo = Undo()
    written = apply_patches(staged, undo)
    assert written == 1000
    assert torch.equal(live.view(torch.int16), ref.view(torch.int16))
    undo.revert()
    assert torch.equal(live.view(torch.int16), base.view(torch.int16))


def test_fp32_parameter_stages_four_byte_values() -> None:
    param = torch.zeros(100, dtype=torch.float32)
    idx = torch.tensor([1, 50, 99])
    (piece,) = prepare([Piece(param, idx, torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))])
    assert piece.values.dtype == torch.float32 and piece.indices.dtype == torch.int32
    assert staged_nbytes([piece]) == 3 * 8
    apply_patches([piece])
    assert param[[1, 50, 99]].tolist() == [1.0, 2.0, 3.0]


def test_staged_values_do_not_keep_the_patch_alive() -> None:
    param = torch.zeros(100, dtype=torch.bfloat16)
    values = torch.randn(100).to(torch.bfloat16)
    (piece,) = compact([Piece(param, torch.arange(10, 20), values[10:20])])
    assert piece.values.untyped_storage().nbytes() == 10 * 2


@pytest.mark.parametrize("tp", [1, 2])
def test_staged_bytes_per_changed_element_of_bf16(tp_world: TPWorld, tp: int) -> None:
    """Sparse and relative patches of a real TP shard: at most 6 staged bytes per element
    written (int32 index + 16-bit value); the result equals the int64 path."""
    params = tp_world.model("llama_gqa").checkpoint_params()
    full = random_checkpoint(params, seed=5)
    patches, _ = make_step(full, 0)
    sparse = [p for p in patches if p.indices is not None]
    assert any(p.relative for p in sparse) and any(not p.relative for p in sparse)
    live, ref = tp_world.build("llama_gqa", tp, tp - 1), tp_world.build("llama_gqa", tp, tp - 1)
    live.load_weights(iter(full.items()))
    ref.load_weights(iter(full.items()))
    shardmap = ShardMap.from_model(live, params, loader=LOADER)
    staged = prepare(merge_pieces(compact(translate_all(shardmap, sparse))))
    written = sum(p.values.numel() for p in staged)
    assert written > 0 and staged_nbytes(staged) <= 6 * written
    before = state_bits(live)
    undo = Undo()
    apply_patches(staged, undo)
    ref_map = ShardMap.from_model(ref, params, loader=LOADER)
    apply_patches(translate_all(ref_map, sparse))  # int64, unprepared
    want = state_bits(ref)
    for name, bits in state_bits(live).items():
        assert torch.equal(bits, want[name]), name
    undo.revert()
    for name, bits in state_bits(live).items():
        assert torch.equal(bits, before[name]), name

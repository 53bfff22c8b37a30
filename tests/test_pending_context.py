"""The drafter's pending context (engine/batch.py, decode.pack_context): each cycle's tapped rows
are kept as pieces and packed once, when the drafter runs, into the same rows the drafter would
get from repacking every cycle: row b's kept rows of every cycle, in order."""

from __future__ import annotations

import random

from dflash_batch.engine import decode, load_engine
from dflash_batch.engine.batch import BatchDecoder
from dflash_batch.engine.widths import CostModel, WidthPolicy

import mlx.core as mx
import numpy as np
import pytest


def _reference(pieces):
    """Row b: the first counts_i[b] rows of each piece i, concatenated (numpy, one row at a time)."""
    rows = []
    for b in range(pieces[0][0].shape[0]):
        rows.append(np.concatenate([np.array(p)[b, : c[b]] for p, c in pieces], axis=0))
    return rows


@pytest.mark.parametrize("ragged", [False, True])
def test_packed_rows_are_each_rows_kept_rows_in_order(ragged):
    rng = random.Random(0)
    B, H = 5, 3
    pieces = []
    for i in range(7):
        T = rng.choice([1, 1, 4, 8])
        rows = mx.array(np.random.default_rng(i).normal(size=(B, T, H)).astype(np.float32))
        counts = [rng.randint(1, T) if ragged else T for _ in range(B)]
        if ragged and i == 3:
            counts[2] = 0  # a row that joined, its earlier rows dropped
        pieces.append((rows, counts))
    packed, counts = decode.pack_context(pieces)
    want = _reference(pieces)
    assert counts == [len(w) for w in want]
    assert packed.shape == (B, max(counts), H)
    for b in range(B):
        np.testing.assert_array_equal(np.array(packed)[b, : counts[b]], want[b])


def test_no_pieces_or_no_rows_pack_to_nothing():
    assert decode.pack_context([]) == (None, [])
    rows = mx.zeros((2, 1, 3))
    packed, counts = decode.pack_context([(rows, [0, 0]), (rows, [0, 0])])
    assert packed is None and counts == [0, 0]


class _Widths(WidthPolicy):
    """A width policy that verifies the widths it is given, in turn (then 1)."""

    def __init__(self, block, widths):
        super().__init__(block, CostModel())
        self.script = list(widths)

    def width(self, estimates, budgets, tail=None):
        return min(self.script.pop(0) if self.script else 1, max(budgets))


def test_plain_cycles_do_not_repack_the_backlog(tiny_pair, monkeypatch):
    """Sixty plain cycles then a drafting one: the backlog is packed once, by the drafting cycle
    (packing it every cycle copies it again each time: quadratic in the plain cycles)."""
    engine = load_engine(*map(str, tiny_pair))
    packed = []
    real = decode.pack_context

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        packed.append(out[1])
        return out

    monkeypatch.setattr(decode, "pack_context", spy)
    prompts = ["Count: one two three", "Tell me about the number seven."]
    requests = [engine.request(p, max_tokens=80, index=i) for i, p in enumerate(prompts)]
    widths = [1] * 60 + [4] + [1] * 5 + [4]
    out = {}
    for index, piece in BatchDecoder(
        engine, requests, 2, _Widths(engine.block_size, widths)
    ).steps():
        out.setdefault(index, []).extend(piece.token_ids)
    assert len(packed) == 2, len(packed)  # the two drafting cycles alone
    assert packed[0] == [60, 60]  # a row per plain cycle
    assert all(
        1 + 5 <= n <= 4 + 5 for n in packed[1]
    )  # the drafting cycle's kept rows, then 5 plain
    # greedy output is the target's own whatever the widths (the engine's plain decoding)
    plain = load_engine(str(tiny_pair[0]), None)
    for i, p in enumerate(prompts):
        assert out[i] == plain.generate(p, max_tokens=80).token_ids

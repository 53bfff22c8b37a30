"""The batched cycle's host shortcuts: rows with no sampling control or grammar skip the logits
processing, and the rows one cycle finishes free their slots in one update; outputs unchanged
(the lossless and sampling suites check the tokens)."""

from __future__ import annotations

import dflash_batch.engine  # noqa: F401  (BLAS before mlx)
from dflash_batch.engine import load_engine, sampling
from dflash_batch.engine.batch import BatchDecoder

import pytest

from tests.helpers import set_modes


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return load_engine(str(tiny_pair[0]), str(tiny_pair[1]), adaptive_block=False)


def _spy(monkeypatch, owner, name):
    calls, real = [], getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def test_plain_rows_skip_logits_processing_and_controlled_rows_do_not(engine, monkeypatch):
    calls = _spy(monkeypatch, sampling, "process")
    plain = engine.generate_batch(["one", "two", "three"], max_tokens=12, batch_size=3)
    assert calls == [] and all(len(c.token_ids) == 12 for c in plain)
    engine.generate_batch(["one", "two"], max_tokens=12, batch_size=2, repetition_penalty=1.3)
    assert calls  # a penalized batch still goes through sampling.process


def test_rows_finishing_together_free_their_slots_in_one_update(engine, monkeypatch):
    frees = _spy(monkeypatch, BatchDecoder, "_free")
    requests = [
        engine.request(p, max_tokens=5, index=i) for i, p in enumerate(["a b", "c d", "e f", "g h"])
    ]
    decoder = BatchDecoder(engine, requests, 4, engine._width_policy(4))
    done = [piece for _, piece in decoder.steps() if piece.finish_reason is not None]
    assert len(done) == 4
    assert [sorted(args[1]) for args in frees if args[1]] == [[0, 1, 2, 3]]  # one call, every row
    assert decoder.lengths.host == [0] * 4 and decoder.draft_lengths.host == [0] * 4
    assert decoder.lengths.device.tolist() == [0] * 4 and decoder.pending_counts == [0] * 4


def test_a_pass_builds_its_write_columns_once_for_every_layer():
    """Ragged writes of one pass share one [B, T] columns array (not one per layer); it follows
    the lengths as they change."""
    from dflash_batch.engine.ops.batch_cache import Lengths, RaggedKVCache

    import mlx.core as mx

    lengths = Lengths([3, 1, 5])
    layers = [RaggedKVCache(lengths, 16) for _ in range(3)]
    first = lengths.columns(4)
    assert first.tolist() == [[3, 4, 5, 6], [1, 2, 3, 4], [5, 6, 7, 8]]
    for i, cache in enumerate(layers):
        kv = mx.full((3, 2, 4, 8), float(i + 1))
        keys, _ = cache.update_and_fetch(kv, kv)
        assert lengths.columns(4) is first
        assert keys[1, 0, :, 0].tolist()[:6] == [
            0,
            i + 1,
            i + 1,
            i + 1,
            i + 1,
            0,
        ]  # row 1: columns 1..4
    lengths.advance([1, 2, 0])
    assert lengths.columns(4).tolist() == [[4, 5, 6, 7], [3, 4, 5, 6], [5, 6, 7, 8]]


def test_a_cycle_fetches_drafts_and_choices_in_one_sync(engine, monkeypatch):
    """Draft and verify passes are evaluated together: fetching the drafts alone first would
    wait for the draft pass before the verify pass is even queued (two host syncs a cycle)."""
    import mlx.core as mx

    set_modes(monkeypatch, engine, drafts="chain")
    together, real = [], mx.eval

    def spy(*arrays):
        shapes = [tuple(a.shape) for a in arrays if isinstance(a, mx.array)]
        if (
            len(shapes) == 2 and shapes[0][1] + 1 == shapes[1][1]
        ):  # drafted [B, T - 1], chosen [B, T]
            together.append(shapes)
        return real(*arrays)

    monkeypatch.setattr(mx, "eval", spy)
    engine.generate_batch(["one", "two", "three"], max_tokens=20, batch_size=3)
    cycles = sum(c[0] for c in engine.decode_counts.values())
    assert cycles > 1 and len(together) == cycles


def test_prompts_that_finish_one_prefill_pass_choose_their_first_tokens_together(
    engine, monkeypatch
):
    """Three prompts prefilled in one packed pass take their slots and choose their first tokens
    in one choice (one host sync), not one each; then the cycles run."""
    events = []
    choose, run = BatchDecoder.choose, BatchDecoder.run

    def spy_choose(self, logits, rows, *args, **kwargs):
        events.append(("choose", len(rows)))
        return choose(self, logits, rows, *args, **kwargs)

    def spy_run(self, width):
        events.append(("run",))
        return run(self, width)

    monkeypatch.setattr(BatchDecoder, "choose", spy_choose)
    monkeypatch.setattr(BatchDecoder, "run", spy_run)
    alone = [
        engine.generate(p, max_tokens=6).token_ids for p in ["one two", "three", "four five six"]
    ]
    events.clear()
    together = engine.generate_batch(
        ["one two", "three", "four five six"], max_tokens=6, batch_size=3
    )
    assert events[: events.index(("run",))] == [("choose", 3)]
    assert [c.token_ids for c in together] == alone

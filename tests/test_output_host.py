"""The cheap path of ``RowOutput.feed`` (rows without stop strings or logprobs read their text once
per step) gives exactly what the token-by-token path gives: pieces, text, finish reasons and
counts, through EOS, budgets and multi-byte characters split over tokens."""

from __future__ import annotations

import random

import dflash_batch.engine  # noqa: F401  (BLAS before mlx)
from dflash_batch.engine import stopping
from dflash_batch.engine.decode import Step
from dflash_batch.engine.output import RowOutput

import pytest

from benchmarks.shapes import build_tokenizer

EOS = 300


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(
        512
    )  # byte-level: ids < 256 are single bytes, so UTF-8 splits over tokens


def _output(tokenizer, max_tokens):
    out = RowOutput(tokenizer, 5, max_tokens, (), 16)
    out.eos = frozenset({EOS})
    return out


def _pieces(tokenizer, steps, max_tokens):
    out = _output(tokenizer, max_tokens)
    pieces = []
    for k, (tokens, from_draft) in enumerate(steps):
        piece = out.feed(
            Step(tokens=tokens, from_draft=from_draft, drafted=len(tokens) - 1, decoded=k > 0)
        )
        pieces.append(piece)
        if piece.finish_reason is not None:
            break
    s = out.stats
    return ([(p.text, p.token_ids, p.finish_reason, p.stop_reason) for p in pieces],
            (s.generated_tokens, s.accepted_tokens, s.cycles, s.drafted_tokens, s.acceptance_histogram))  # fmt: skip


def _random_steps(tokenizer, rng, eos_rate):
    """A row's steps: its prefill's one token, then blocks of 1..16 with bytes of multi-byte
    characters, other ids and now and then an EOS."""
    text = "".join(rng.choice("ab é€😀\n") for _ in range(80))
    ids = [
        t if rng.random() > 0.2 else rng.randrange(256, 512) for t in tokenizer.encode(text)
    ]  # one id a byte
    ids = [EOS if rng.random() < eos_rate else t for t in ids]
    steps, i = [([ids[0]], 0)], 1
    while i < len(ids):
        n = rng.randint(1, 16)
        steps.append((ids[i : i + n], rng.randint(0, n - 1)))
        i += n
    return steps


@pytest.mark.parametrize("seed", range(40))
def test_plain_rows_read_once_per_step_equal_token_by_token(tokenizer, monkeypatch, seed):
    rng = random.Random(seed)
    steps = _random_steps(tokenizer, rng, eos_rate=rng.choice([0.0, 0.01, 0.05]))
    max_tokens = rng.choice([1, 2, 7, 16, 17, 40, 1000])
    fast = _pieces(tokenizer, steps, max_tokens)
    # the reference: every step token by token, as rows with stop strings or logprobs go
    monkeypatch.setattr(RowOutput, "_feed_plain",
                        lambda self, tokens, k: self._feed_each(Step(tokens=tokens, from_draft=k)))  # fmt: skip
    assert fast == _pieces(tokenizer, steps, max_tokens)


def test_plain_rows_check_stop_text_once_per_step(tokenizer, monkeypatch):
    """The cheap path is taken: one stop-text check per step, not one per token."""
    calls = []
    feed = stopping.StopText.feed
    monkeypatch.setattr(
        stopping.StopText, "feed", lambda self, segment: calls.append(1) or feed(self, segment)
    )
    out = _output(tokenizer, 1000)
    for _ in range(5):
        out.feed(Step(tokens=list(range(97, 113)), from_draft=15, drafted=15, decoded=True))
    assert len(calls) == 5


@pytest.mark.parametrize("seed", range(30))
def test_stop_text_emits_as_early_as_it_may_and_cuts_at_the_first_stop(seed):
    """Fed at random cuts, the emitted text is the stream cut where a stop string first starts;
    after each feed everything is out but the last ``hold`` characters (none held without stops)."""
    rng = random.Random(seed)
    stops = rng.sample(["ab", "ba", "aab", "c", "bbbb", "a\n"], rng.randint(0, 3))
    stream = "".join(rng.choice("ab\nc") if stops else rng.choice("ab") for _ in range(60))
    text, out = stopping.StopText(stops), ""
    first = min((i for i in (stream.find(s) for s in stops) if i != -1), default=None)
    fed, i = "", 0
    while i < len(stream):
        n = rng.randint(0, 7)
        fed += stream[i : i + n]
        i += n
        emitted, hit = text.feed(stream[i - n : i])
        out += emitted
        if hit is not None:
            assert fed.find(hit) == first and out == stream[:first]
            break
        hold = max((len(s) for s in stops), default=1) - 1
        assert all(s not in fed for s in stops)  # no stop string complete yet
        assert out == fed[: max(len(fed) - hold, 0)]
        assert len(text.tail) <= hold  # only what a stop string could still begin in is kept
    else:
        assert first is None
    assert out + text.flush() == (stream if first is None else stream[:first])

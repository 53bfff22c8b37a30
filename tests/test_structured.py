"""Structured output (response_format) under speculation: greedy output equals plain constrained
greedy decoding token for token, whatever the drafts; every output parses and validates against
its schema; rows with different constraints share a batch; a bad schema is refused up front."""

from __future__ import annotations

import json
import re

from dflash_batch.engine import load_engine
from dflash_batch.engine.grammar import Grammars

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from dflash_batch import constraints
from dflash_batch.completion import GenerationError
from tests.scripting import ScriptedDrafts

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "label": {"enum": ["p", "q"]},
    },
    "required": ["x", "label"],
    "additionalProperties": False,
}


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


REGEX = r"[A-Z][a-z]{1,5}-[0-9]{2,3}"
FORMATS = [
    ("person", schema_format(PERSON)),
    ("point", schema_format(POINT)),
    ("regex", {"type": "regex", "regex": REGEX}),
    (
        "grammar",
        {
            "type": "grammar",
            "grammar": 'start: "(" item ("," item){0,3} ")"\nitem: /[0-9]{1,2}/ | "x"',
        },
    ),
]
PROMPTS = ["Hi", "Tell me a story about the sea.", "Give the data as JSON:"]


def check(kind, text):
    """The output parses and validates against its constraint."""
    if kind in ("person", "point"):
        jsonschema.validate(json.loads(text), PERSON if kind == "person" else POINT)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert re.fullmatch(r"\((?:[0-9]{1,2}|x)(?:,(?:[0-9]{1,2}|x)){0,3}\)", text), text


@pytest.fixture(scope="module")
def engines(tiny_pair):
    return load_engine(str(tiny_pair[0]), str(tiny_pair[1]), adaptive_block=False), load_engine(
        str(tiny_pair[0]), draft=None
    )


def test_constrained_greedy_equals_plain_constrained_greedy(engines, monkeypatch):
    spec, plain = engines
    scripted = ScriptedDrafts(monkeypatch)
    accepted = 0
    for n, (kind, rf) in enumerate(FORMATS):
        for m, prompt in enumerate(PROMPTS):
            ids = spec.encode(prompt)
            ref = plain.generate(ids, max_tokens=80, response_format=rf)
            assert ref.finish_reason == "stop", (kind, ref.text)
            check(kind, ref.text)
            # drafts: the reference, corrupted at random; many corrupt drafts are ones the grammar forbids
            scripted(ids + ref.token_ids + [0] * 16, p_wrong=[0.0, 0.2, 0.5][m], seed=n * 3 + m)
            c = spec.generate(ids, max_tokens=80, response_format=rf)
            assert c.token_ids == ref.token_ids, (kind, prompt)
            accepted += c.stats.accepted_tokens
    assert accepted > 100  # drafts were checked against the grammar and kept

    # Negative control: masks not walked along the drafts (every position gets the mask after the
    # committed output alone): the output is no longer the plain constrained one.
    real = Grammars.masks

    def unwalked(self, walks, B, T):
        here = real(self, [(b, m, []) for b, m, _ in walks], B, 1)
        return mx.broadcast_to(here, (B, T, here.shape[-1]))

    monkeypatch.setattr(Grammars, "masks", unwalked)
    diverged = 0
    for n, (kind, rf) in enumerate(FORMATS[:2]):
        ids = spec.encode(PROMPTS[0])
        ref = plain.generate(ids, max_tokens=80, response_format=rf)
        scripted(ids + ref.token_ids + [0] * 16, p_wrong=0.0)
        try:
            diverged += (
                spec.generate(ids, max_tokens=80, response_format=rf).token_ids != ref.token_ids
            )
        except RuntimeError:  # the grammar refused what the unwalked masks let through
            diverged += 1
    assert diverged == 2


def test_sampled_outputs_validate_and_rows_mix_in_one_batch(engines):
    """Rows with different constraints (and none), greedy and sampled, in one batch: each row
    emits what plain decoding of it alone emits, and every constrained output validates."""
    spec, plain = engines
    rows = []
    for i, (kind, rf) in enumerate(FORMATS * 2):
        rows.append(
            (
                kind,
                PROMPTS[i % 3],
                dict(response_format=rf, temperature=1.0 if i >= 4 else 0.0, top_p=0.95),
            )
        )
    rows.append((None, "Hi", dict(temperature=0.7)))
    requests = [
        spec.request(p, 80, seed=100 + i, index=i, **kw) for i, (_, p, kw) in enumerate(rows)
    ]
    together = dict(spec.run(requests, batch_size=len(rows)))
    for i, (kind, prompt, kw) in enumerate(rows):
        alone = plain.generate(prompt, max_tokens=80, seed=100 + i, **kw)
        assert together[i].token_ids == alone.token_ids, (i, kind)
        if kind is not None:
            assert together[i].finish_reason == "stop", together[i].text
            check(kind, together[i].text)
    for seed in range(6):  # sampled person records, all valid
        c = spec.generate(
            "Give the data as JSON:",
            max_tokens=80,
            temperature=1.5,
            seed=seed,
            response_format=schema_format(PERSON),
        )
        check("person", c.text)


def test_bad_response_format_is_refused_before_generation(engines):
    spec, _ = engines
    bad = [
        {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "frob"}}},
        {"type": "json_schema", "json_schema": {"name": "t"}},
        {"type": "regex", "regex": "(("},
        {"type": "xml"},
        "json",
    ]
    for rf in bad:
        with pytest.raises(GenerationError, match="response_format"):
            spec.request("Hi", 10, response_format=rf)
        with pytest.raises(constraints.BadValue):
            constraints.grammar(rf)
    # a batch with one bad row fails before any row is generated
    with pytest.raises(GenerationError, match="prompt 0: response_format"):
        list(spec.stream_batch(["Hi", "Hi"], response_format=bad[0]))


def test_constrained_rows_draft_along_their_grammar(tiny_pair, monkeypatch):
    """A constrained row's drafts are the drafter's likeliest tokens the grammar allows, each after
    the drafts before it: the share of draft tokens the grammar accepts (checked at every verify
    pass with a matcher at the row's committed output) is high, and low without it; the output
    stays plain constrained greedy."""
    spec = load_engine(str(tiny_pair[0]), str(tiny_pair[1]), adaptive_block=False)
    spec.grammar_drafts = True
    plain = load_engine(str(tiny_pair[0]), draft=None)
    real = Grammars.masks
    seen = []

    def spy(self, walks, B, T):
        for _, m, d in walks:
            seen.append((m.validate_tokens(list(d)), len(d)))
        return real(self, walks, B, T)

    monkeypatch.setattr(Grammars, "masks", spy)

    def share():
        seen.clear()
        for kind, rf in FORMATS:
            c = spec.generate("Give the data as JSON:", max_tokens=60, response_format=rf)
            assert (
                c.token_ids
                == plain.generate(
                    "Give the data as JSON:", max_tokens=60, response_format=rf
                ).token_ids
            )
        return sum(v for v, _ in seen) / sum(n for _, n in seen)

    walked = share()
    assert walked > 0.6, walked  # the rest: drafts past the end of a complete output
    monkeypatch.setattr(
        Grammars, "draft", lambda self, matchers, ids, logits: [[] for _ in matchers]
    )  # negative control
    assert share() < 0.3


def test_masks_stay_packed_and_apply_bit_for_bit(engines):
    """The masks reach the device packed, 32 tokens a word ([B, T, words] uint32, not [B, T, V]
    bool), and ``sampling.masked`` applies them as the unpacked bits would: token v allowed iff
    bit v % 32 of word v // 32 is set (checked against numpy's unpackbits, a vocabulary that is
    not a multiple of 32, fp32 and bf16 logits); a constrained row's allowed set at a position is
    what llguidance's matcher accepts there."""
    from dflash_batch.engine.sampling import masked

    spec, _ = engines
    grammars = spec.grammars
    m = grammars.matcher(constraints.grammar(FORMATS[2][1]))  # the regex
    drafts = spec.tokenizer.encode("Ab", add_special_tokens=False)
    packed = grammars.masks([(1, m, drafts)], 2, len(drafts) + 1)
    assert packed.dtype == mx.uint32 and packed.shape == (2, len(drafts) + 1, grammars.words)
    V = spec.target.vocab_size
    logits = mx.zeros((2, len(drafts) + 1, V))
    allowed = np.isfinite(np.array(masked(logits, packed)))
    assert allowed[0].all()  # the row without a grammar allows everything
    for tok in range(
        min(V, spec.tokenizer.vocab_size)
    ):  # position 0: what the fresh matcher accepts
        assert allowed[1, 0, tok] == (m.validate_tokens([tok]) == 1), tok

    rng = np.random.default_rng(0)
    for V, dtype in ((100, mx.float32), (77, mx.bfloat16)):
        words = rng.integers(0, 2**32, (3, 5, (V + 31) // 32), dtype=np.uint64).astype(np.uint32)
        logits = mx.array(rng.normal(size=(3, 5, V)).astype(np.float32)).astype(dtype)
        bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[..., :V].astype(bool)
        expected = np.where(bits, np.array(logits.astype(mx.float32)), -np.inf)
        got = masked(logits, mx.array(words))
        assert got.dtype == mx.float32
        np.testing.assert_array_equal(np.array(got), expected)


def test_positions_past_a_forbidden_draft_cost_no_mask_and_the_stop_stays_masked(engines):
    """The walk along the drafts stops at the first draft the grammar forbids: the position before
    it is masked (the target cannot choose the forbidden draft, so acceptance ends there) and the
    positions after it are left allowing everything (never committed, no mask computed)."""
    from dflash_batch.engine.sampling import masked

    spec, _ = engines
    grammars = spec.grammars
    m = grammars.matcher(constraints.grammar(FORMATS[2][1]))  # [A-Z][a-z]{1,5}-[0-9]{2,3}
    upper, bad, lower = (
        spec.tokenizer.encode(t, add_special_tokens=False) for t in ("A", "9", "b")
    )
    assert len(upper) == len(bad) == len(lower) == 1
    drafts = upper + bad + lower  # "9" after "A" is forbidden
    T = len(drafts) + 1
    packed = grammars.masks([(0, m, drafts)], 1, T)
    allowed = np.isfinite(np.array(masked(mx.zeros((1, T, spec.target.vocab_size)), packed)))
    assert not allowed[0, 0, bad[0]] and allowed[0, 0, upper[0]]  # position 0: the fresh grammar
    assert not allowed[0, 1, bad[0]] and allowed[0, 1, lower[0]]  # after "A": the stop, masked
    assert allowed[0, 2:].all()  # past the forbidden draft: allow all


def test_structured_benchmark_runs_on_a_random_weight_shape(capsys):
    """benchmarks/structured --shape: a random-weight target and drafter of a shapes.py shape, at the
    same scripted acceptance both ways (so the ratio compares like with like), with the host ms of
    each grammar piece per cycle."""
    from benchmarks import structured

    out = structured.main(
        ["--shape", "qwen3-tiny", "--reps", "1", "--max-tokens", "24", "--pieces", "2"]
    )
    assert out["shape"] == "qwen3-tiny" and out["vocab"] == 512
    assert out["tokens_per_cycle"]["constrained"] == out["tokens_per_cycle"]["unconstrained"]
    assert out["ratio"] > 0
    assert set(out["host_ms_per_cycle"][2]) == {"fetch", "masks", "apply", "commit"}


def test_drafts_are_queued_on_their_own_before_the_verify_pass(engines, monkeypatch):
    """For constrained rows the drafts get an async_eval of their own, queued before the verify
    pass's: an array fetched after one async_eval of the logits waits for that whole graph (seen on
    MLX 0.32.4, CPU: the fetch returned when the pass did), so the masks started only after the pass instead of
    running while it does. Checked on the calls (timing on a shared CPU is not reliable)."""
    spec, plain = engines
    real = mx.async_eval
    calls = []

    def spy(*arrays):
        calls.append([(a.shape, a.dtype) for a in arrays])
        return real(*arrays)

    monkeypatch.setattr(mx, "async_eval", spy)
    rf = FORMATS[1][1]
    c = spec.generate("Hi", max_tokens=12, response_format=rf)
    monkeypatch.setattr(mx, "async_eval", real)
    assert c.token_ids == plain.generate("Hi", max_tokens=12, response_format=rf).token_ids
    V = spec.target.vocab_size
    # b: the logits of a drafting cycle (T > 1; a plain cycle has no drafts to queue)
    pairs = [
        (a, b)
        for a, b in zip(calls, calls[1:])
        if len(b) == 1 and b[0][0][-1] == V and b[0][0][1] > 1
    ]
    assert pairs and all(a == [((1, b[0][0][1] - 1), mx.int32)] for a, b in pairs), calls

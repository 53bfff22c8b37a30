"""What speculation saved, per row: its share of the decode cycles it rode in and its tokens at
a plain cycle's share each, from the cost model's width-1 cost at the batch size each cycle ran
at; and control rows, decoded plainly in a drafting batch, exact (fp32, CPU). Every figure comes
from a given cost model and a scripted clock (each cycle takes one second): none from a timing."""

from __future__ import annotations

from dflash_batch.engine import batch, load_engine
from dflash_batch.engine.widths import CostModel

import pytest

from dflash_batch.request import Options, Request
from tests.helpers import StepClock, greedy_reference
from tests.scripting import ScriptedDrafts

PROMPT = [5, 17, 3, 88, 41, 9, 23, 60]


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setattr(batch, "time", StepClock(1.0))  # each cycle takes 1 s


def _costs(**kw):
    return CostModel(
        t0=1.0, t1=0.25, window=0, **kw
    )  # a plain cycle over B rows: 1 + 0.25 B seconds


def _prompts(n):
    return [[(7 * b + i) % 90 + 4 for i in range(6 + b)] for b in range(n)]


def test_plain_cycles_estimate_by_hand(tiny_pair, clock):
    """Drafting too dear to try (every cycle plain): rows of 3 and 5 tokens decode together for
    2 cycles at 2 rows (a plain cycle 1.5 s, 0.75 s a row), then the longer alone for 2 cycles
    (1.25 s). Row A: 2 x 0.75 = 1.5 s plain, its share 2 x 0.5 = 1 s; row B: 1.5 + 2 x 1.25 = 4 s
    plain, its share 1 + 2 = 3 s."""
    engine = load_engine(*map(str, tiny_pair), cost_model=_costs(d0=1000.0))
    a, b = engine.generate_batch(_prompts(2), max_tokens=[3, 5], batch_size=2)
    assert [a.stats.generated_tokens, b.stats.generated_tokens] == [3, 5]  # no EOS cut them
    assert a.stats.drafted_tokens == b.stats.drafted_tokens == 0
    assert a.stats.plain_seconds_est == pytest.approx(1.5)
    assert a.stats.decode_share_s == pytest.approx(1.0)
    assert b.stats.plain_seconds_est == pytest.approx(4.0)
    assert b.stats.decode_share_s == pytest.approx(3.0)
    assert b.stats.speedup_vs_plain == pytest.approx(4.0 / 3.0)
    assert b.stats.to_dict()["speedup_vs_plain"] == pytest.approx(4.0 / 3.0)


@pytest.mark.parametrize("rows", [1, 2])
def test_drafting_rows_estimate_by_hand(tiny_pair, clock, monkeypatch, chain_drafts, rows):
    """Every draft right and drafting cheap: rows of one budget commit together, at 1 + 0.25 B
    seconds a plain cycle (1.25 s for one row, 0.75 s a row for two), whatever the widths. The
    estimate is (tokens - 1) x that; the share is cycles x 1 s / B; far fewer cycles than tokens."""
    target, draft = map(str, tiny_pair)
    engine = load_engine(target, draft, cost_model=_costs())
    script = ScriptedDrafts(monkeypatch)
    prompts = _prompts(rows)
    eos = engine.tokenizer.eos_token_ids
    for p in prompts:
        script(p + greedy_reference(target, p, 40, eos) + [0] * 16, p_wrong=0.0)
    per_row = (1 + 0.25 * rows) / rows
    for c in engine.generate_batch(prompts, max_tokens=40, batch_size=rows):
        s = c.stats
        assert s.cycles < s.generated_tokens - 1 and s.drafted_tokens > 0  # it drafted, and it paid
        assert s.plain_seconds_est == pytest.approx((s.generated_tokens - 1) * per_row)
        assert s.decode_share_s == pytest.approx(s.cycles / rows)
        assert s.speedup_vs_plain == pytest.approx(
            (s.generated_tokens - 1) * per_row * rows / s.cycles
        )


def test_shares_add_up_to_the_decode_time(tiny_pair, clock):
    """The rows' shares of each cycle add up to the cycles' seconds (one each here)."""
    engine = load_engine(*map(str, tiny_pair), cost_model=_costs())
    done = engine.generate_batch(_prompts(4), max_tokens=[4, 9, 17, 30], batch_size=3)
    cycles = sum(n for n, _, _ in engine.decode_counts.values())
    assert sum(c.stats.decode_share_s for c in done) == pytest.approx(cycles)


def test_without_drafter_the_plain_estimate_is_the_time_taken(qwen3_target, clock):
    engine = load_engine(str(qwen3_target), None)
    for c in engine.generate_batch(_prompts(3), max_tokens=[4, 9, 12], batch_size=3):
        assert c.stats.plain_seconds_est == pytest.approx(c.stats.decode_share_s)
        assert c.stats.speedup_vs_plain == pytest.approx(1.0)


def test_a_fixed_width_has_no_estimate(tiny_pair, clock):
    """Whole blocks every cycle: no plain cycle was ever measured, so no figure is made up."""
    engine = load_engine(*map(str, tiny_pair), adaptive_block=False)
    c = engine.generate(PROMPT, max_tokens=12)
    assert c.stats.plain_seconds_est is None and c.stats.speedup_vs_plain is None
    assert c.stats.decode_share_s > 0


# -- control rows ---------------------------------------------------------------------------------
def _requests(n, budgets, control, **options):
    return [Request(f"r{i}", _prompts(n)[i], Options(max_tokens=budgets[i], **options), control=i in control)
            for i in range(n)]  # fmt: skip


@pytest.mark.parametrize("drafts", ["chain", "tree"])
def test_control_rows_decode_plainly_and_exactly(tiny_pair, monkeypatch, drafts):
    """In a batch whose other rows draft (every draft right, drafting cheap), control rows verify
    no draft: one token a cycle, the target's own greedy output."""
    target, draft = map(str, tiny_pair)
    engine = load_engine(
        target, draft, cost_model=CostModel(t0=1.0, t1=0.05, d0=0.5, window=0), drafts=drafts
    )
    script = ScriptedDrafts(monkeypatch)
    budgets = [30, 24, 30, 17, 9]
    eos = engine.tokenizer.eos_token_ids
    refs = [greedy_reference(target, p, n, eos) for p, n in zip(_prompts(5), budgets)]
    for p, ref in zip(_prompts(5), refs):
        script(p + ref + [0] * 16, p_wrong=0.0)
    requests = _requests(5, budgets, control={1, 3})
    done = {r.id: c for r, c in engine.generate_requests(requests, batch_size=5)}
    for req, ref in zip(requests, refs):
        s = done[req.id].stats
        assert done[req.id].token_ids == ref, req.id
        assert s.control == req.control
        if req.control:
            assert s.drafted_tokens == 0 and s.accepted_tokens == 0
            assert s.cycles == s.generated_tokens - 1  # one token a cycle
        else:
            assert s.drafted_tokens > 0 and s.cycles < s.generated_tokens - 1


def test_a_sampled_control_row_gives_the_seeded_output(tiny_pair):
    """A control row samples its tokens from the same noise: its output is the seeded output.
    Each job on an engine of its own: once an engine has drafted, it probes a batch's tail at
    the least share (engine/widths.py), and the drafted rows here must draft."""

    def engine():
        costs = CostModel(t0=1.0, t1=0.05, d0=0.5, window=0)
        return load_engine(*map(str, tiny_pair), cost_model=costs)

    options = dict(temperature=0.9, seed=11)
    drafted = {
        r.id: c
        for r, c in engine().generate_requests(
            _requests(3, [20] * 3, set(), **options), batch_size=3
        )
    }
    control = list(
        engine().generate_requests(_requests(3, [20] * 3, {0, 2}, **options), batch_size=3)
    )
    for r, c in control:
        assert c.token_ids == drafted[r.id].token_ids
        assert (c.stats.drafted_tokens == 0) == r.control
    assert all(c.stats.drafted_tokens > 0 for c in drafted.values())


@pytest.mark.parametrize("cut", ["eos", "budget"])
def test_a_cut_inside_a_block_counts_only_the_tokens_used(qwen3_target, cut):
    """A cycle commits 5 tokens; an EOS third (counted, as plain decoding would need its cycle)
    or the budget after the third ends the row: 3 tokens at 0.25 s plain each, not 5."""
    from dflash_batch.engine.decode import Step
    from dflash_batch.engine.output import RowOutput

    tokenizer = load_engine(str(qwen3_target), None).tokenizer
    eos = min(tokenizer.eos_token_ids)
    out = RowOutput(
        tokenizer, prompt_tokens=4, max_tokens=4 if cut == "budget" else 50, stops=(), block_size=8
    )
    out.feed(Step([40]))  # the prefill's token
    out.timed(2.0, 0.25)
    third = eos if cut == "eos" else 42
    piece = out.feed(Step([41, 43, third, 44, 45], from_draft=4, drafted=7, decoded=True))
    assert piece.finish_reason == ("stop" if cut == "eos" else "length")
    assert piece.stats.plain_seconds_est == pytest.approx(0.75)
    assert piece.stats.decode_share_s == pytest.approx(2.0)


def test_the_benchmark_smoke_run(tmp_path):
    """benchmarks/saved_estimate.py on a tiny random pair: both arms through the runner, the same
    text, each figure of a round there, JSON and Markdown written."""
    import json

    from benchmarks import saved_estimate

    result = saved_estimate.main(["--smoke", "--out", str(tmp_path / "saved.md")])
    [r] = result["rounds"]
    assert r["outputs_identical"] and r["control_rows"] > 0 and r["rows"] + r["control_rows"] == 4
    assert (
        r["estimate_s"] > 0
        and r["real_plain_s"] > 0
        and r["error"] == pytest.approx(r["estimate_s"] / r["real_plain_s"] - 1)
    )
    assert json.loads((tmp_path / "saved.json").read_text())["median"]["error"] == pytest.approx(
        r["error"]
    )
    assert "| median |" in (tmp_path / "saved.md").read_text()

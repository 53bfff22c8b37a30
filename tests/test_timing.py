"""Pass costs given to the engine (``load_engine(cost_model=...)``): no warm-up times a pass, so
the widths an adaptive engine chooses, and what tests assert of them, hang on no machine's load."""

from __future__ import annotations

from dflash_batch.engine import load_engine, warmup

from tests.helpers import fixed_costs


def test_an_engine_given_its_costs_times_no_pass(tiny_pair, monkeypatch):
    def timed(*args, **kwargs):
        raise AssertionError("a pass was timed")

    monkeypatch.setattr(warmup, "measure_costs", timed)
    costs = fixed_costs()
    engine = load_engine(*map(str, tiny_pair), cost_model=costs)
    prompts = [engine.encode("Count: one two three"), engine.encode("Tell me about seven. " * 20)]
    engine.generate_batch(prompts, max_tokens=12, batch_size=2)
    engine.generate(prompts[0], max_tokens=12)
    assert engine._width_policy(2).cost is costs and engine._width_policy(1).cost is costs
    assert engine.cost == {}  # nothing measured


def test_the_given_costs_choose_the_widths(tiny_pair):
    """Costs under which drafting never pays keep the engine plain; costs under which it does
    make it draft: the widths follow the model given, not timings."""
    from dflash_batch.engine.widths import CostModel

    prompt = [5, 6, 7, 8]
    dear = load_engine(*map(str, tiny_pair), cost_model=CostModel(t0=1.0, d0=1000.0, window=0))
    assert dear.generate(prompt, max_tokens=40).stats.cycles == 39  # one token a cycle
    assert dear.acceptance.seen[0] == 0  # no draft verified
    cheap = load_engine(*map(str, tiny_pair), cost_model=fixed_costs())
    cheap.generate(prompt, max_tokens=40)
    assert cheap.acceptance.seen[0] > 0

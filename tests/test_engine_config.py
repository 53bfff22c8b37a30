"""One EngineConfig holds the engine's settings, checked when it is made (before any model is
loaded); one table lists the engine's environment variables."""

from __future__ import annotations

import dataclasses
import re

from dflash_batch.engine import load_engine
from dflash_batch.engine import settings as engine_settings
from dflash_batch.engine.config import FIELDS, EngineConfig
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.ops import attention, switch

import pytest

from tests.helpers import fixed_costs
from tests.runner_fixtures import REPO


@pytest.mark.parametrize(
    "field, value", [("prefill_chunk", 0), ("prefill_tokens", 0), ("prefix_cache_mb", -1)]
)
def test_a_bad_setting_is_refused_naming_it_before_any_model_loads(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
    with pytest.raises(ValueError, match=field):  # not a missing-model error: checked first
        load_engine(str(tmp_path / "no-such-model"), None, **{field: value})


def test_an_unknown_setting_is_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match="prefil_chunk"):
        load_engine(str(tmp_path / "no-such-model"), None, prefil_chunk=8)


def test_the_config_is_slotted_and_lists_the_engine_settings():
    config = EngineConfig(prefill_chunk=7)
    with pytest.raises(AttributeError):
        config.prefill_chunks = 8  # a misspelt setting is no silent new attribute
    assert set(FIELDS) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert {"block_size", "batch_size", "prefill_chunk", "cost_model", "max_context"} <= set(FIELDS)


def test_load_engine_passes_its_settings_down(tiny_pair):
    engine = load_engine(
        *map(str, tiny_pair), prefill_chunk=7, prefill_tokens=30, prefix_cache_mb=0
    )
    assert isinstance(engine.settings, EngineConfig) and engine.settings.prefill_chunk == 7
    assert (engine.prefill_chunk, engine.prefill_tokens, engine.prefixes) == (7, 30, None)
    with pytest.raises(TypeError, match="not both"):
        Engine(engine.target.model, engine.tokenizer, settings=EngineConfig(), prefill_chunk=3)


def test_every_engine_variable_is_in_the_one_table():
    """Each DFLASH_BATCH_* name the engine's code spells appears in settings.variables(), with
    a default and a line of doc."""
    spelled = set()
    for path in (REPO / "dflash_batch" / "engine").rglob("*.py"):
        spelled |= set(re.findall(r"DFLASH_BATCH_[A-Z_]+", path.read_text()))
    spelled |= {"DFLASH_BATCH_CACHE"}  # read in paths.py, for the engine's model cache
    spelled -= {"DFLASH_BATCH_HOME"}  # the runner's job home, named in a docstring
    table = {v.name: v for v in engine_settings.variables()}
    assert spelled <= set(table), spelled - set(table)
    assert all(v.default and v.doc for v in table.values())


@pytest.mark.parametrize("field", [s.field for s in switch.SWITCHES])
def test_a_routing_mode_is_a_checked_setting_defaulted_from_its_variable(
    monkeypatch, tmp_path, field
):
    route = switch.BY_FIELD[field]
    other = next(m for m in route.modes if m != route.elsewhere)
    monkeypatch.delenv(route.env, raising=False)
    assert getattr(EngineConfig(), field) == route.elsewhere  # this CPU's default
    monkeypatch.setenv(route.env, other)
    assert getattr(EngineConfig(), field) == other
    assert (
        getattr(EngineConfig(**{field: route.elsewhere}), field) == route.elsewhere
    )  # set in code: first
    with pytest.raises(ValueError, match=field):
        load_engine(str(tmp_path / "no-such-model"), None, **{field: "no-such-mode"})


def test_two_engines_in_one_process_keep_their_own_routes(tiny_pair):
    """Two engines of other routing modes and ragged routes, their steps interleaved: each step
    runs under its own engine's routes, and none leaks to the code between the steps."""
    a = load_engine(
        *map(str, tiny_pair),
        attention="reference",
        drafts="chain",
        cost_model=dataclasses.replace(fixed_costs(), route="sdpa"),
    )
    b = load_engine(
        *map(str, tiny_pair), attention="stock", drafts="tree", cost_model=fixed_costs()
    )
    seen = []
    route = attention._route

    def spy(q, k, v, min_rows=2):
        routes = switch.current()
        seen.append((routes.attention, routes.ragged, routes.drafts))
        return route(q, k, v, min_rows)

    prompts = ["one two three four five six seven eight", "nine"]  # rows of their own lengths
    streams = {
        "a": a.stream_batch(prompts, max_tokens=24),
        "b": b.stream_batch(prompts, max_tokens=24),
    }
    steps = {"a": set(), "b": set()}
    outputs = {"a": {}, "b": {}}
    ambient = switch.current()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(attention, "_route", spy)
        while streams:
            for name in list(streams):
                seen.clear()
                try:
                    index, completion = next(streams[name])
                except StopIteration:
                    del streams[name]
                    continue
                outputs[name][index] = completion.token_ids
                steps[name] |= set(seen)
                assert switch.current() == ambient  # nothing left in force between steps
    assert steps["a"] == {("reference", "sdpa", "chain")}
    assert steps["b"] == {("stock", "block", "tree")}
    assert outputs["a"] == outputs["b"]  # lossless both ways


def test_the_configuration_reference_is_written_from_the_table():
    """docs/configuration.md is ``settings.markdown()`` as it stands (regenerate:
    ``python -m dflash_batch.engine.settings > docs/configuration.md``), one row per variable."""
    text = (REPO / engine_settings.REFERENCE).read_text()
    assert text == engine_settings.markdown(), "docs/configuration.md is stale: regenerate it"
    for variable in engine_settings.variables():
        assert f"| `{variable.name}` | {variable.default} |" in text


def test_the_clis_help_lists_the_engine_variables(capsys):
    from dflash_batch.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "dflash-batch submit" in out  # the examples still
    for variable in engine_settings.variables():
        assert f"{variable.name} (default: {variable.default})" in out


def test_steps_run_under_their_routes_to_the_end_even_when_stopped_early():
    """``switch.stepping``: each step, and the closing of steps a consumer stops reading, under
    the routes given; the consumer's code between steps under its own."""
    seen = []

    def steps():
        try:
            for i in range(3):
                seen.append(("step", switch.current().attention))
                yield i
        finally:
            seen.append(("closed", switch.current().attention))

    routes = switch.Routes(attention="reference")
    stepped = switch.stepping(routes, steps())
    assert next(stepped) == 0 and switch.current().attention == "stock"
    stepped.close()
    assert seen == [("step", "reference"), ("closed", "reference")]

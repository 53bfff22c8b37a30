"""The sampling controls are written once (``request.SamplingControls``: name, default, check):
request options, job specs, the CLI and the engine's requests all take them from there, with the
messages, YAML keys and config hashes they had."""

from __future__ import annotations

import dataclasses

import pytest

from dflash_batch import checks, cli
from dflash_batch.request import CONTROLS, Options, SamplingControls, control, resolve_options
from dflash_batch.runner.spec import SAMPLING_KEYS, JobSpec, load_spec

# Each control's default, and a bad value with the message it gets (as before the one class).
EXPECTED = {
    "top_k": (0, -1, "must be an integer >= 0, got -1"),
    "top_p": (1.0, 0, "must be a number in (0, 1], got 0"),
    "min_p": (0.0, 1.0, "must be a number in [0, 1), got 1.0"),
    "repetition_penalty": (1.0, 0, "must be a number > 0, got 0"),
    "presence_penalty": (0.0, 2.5, "must be a number in [-2, 2], got 2.5"),
    "frequency_penalty": (0.0, float("nan"), "must be a finite number, got nan"),
    "logprobs": (False, 1, "must be true or false, got 1"),
    "top_logprobs": (0, 21, "must be an integer from 0 to 20, got 21"),
    "response_format": (None, {"type": "yaml"}, "type"),
}


def test_one_class_holds_each_controls_name_default_and_check():
    assert CONTROLS == SamplingControls.defaults() == {k: d for k, (d, _, _) in EXPECTED.items()}
    for name, (_, bad, says) in EXPECTED.items():
        with pytest.raises(checks.BadValue, match=None) as e:
            SamplingControls.check(name, bad)
        assert says in str(e.value), name
        with pytest.raises(checks.BadValue):
            control(name, bad)  # the shared check, by its old name
    assert control("top_p", 1) == 1.0 and isinstance(control("top_p", 1), float)


def test_options_and_job_specs_take_their_controls_from_it():
    for cls in (Options, JobSpec):
        assert issubclass(cls, SamplingControls)
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        assert {k: fields[k] for k in CONTROLS} == CONTROLS, cls
    assert set(CONTROLS) <= set(SAMPLING_KEYS) and set(CONTROLS) <= set(cli.OVERRIDE_KEYS)
    assert (
        Options(top_k=3, min_p=0.1).as_kwargs()["top_k"] == 3
        and "top_p" not in Options(top_k=3).as_kwargs()
    )
    spec = JobSpec(top_p=0.5, logprobs=True)
    assert spec.controls() == SamplingControls(top_p=0.5, logprobs=True)
    assert resolve_options(spec, {"top_k": 2}).controls() == SamplingControls(
        top_k=2, top_p=0.5, logprobs=True
    )


def test_spec_errors_yaml_keys_and_config_hash_are_unchanged(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    with pytest.raises(Exception, match="'min_p' must be a number in \\[0, 1\\), got 1.5"):
        load_spec({"input": str(src), "sampling": {"min_p": 1.5}})
    # hashes as before the controls existed: a control at its default leaves the hash alone
    plain = load_spec({"input": str(src)})
    assert (
        plain.config_hash()
        == load_spec({"input": str(src), "sampling": {"top_k": 0, "logprobs": False}}).config_hash()
    )
    assert (
        plain.config_hash()
        != load_spec({"input": str(src), "sampling": {"top_k": 1}}).config_hash()
    )


def test_the_engine_builds_its_request_from_the_controls(tiny_pair):
    from dflash_batch.engine import load_engine

    from dflash_batch.completion import GenerationError

    engine = load_engine(str(tiny_pair[0]), str(tiny_pair[1]))
    r = engine.request("Hi", top_k=3, repetition_penalty=1.2, top_logprobs=2)
    assert (
        r.controls == SamplingControls(top_k=3, repetition_penalty=1.2, top_logprobs=2)
        and r.logprobs == 2
    )
    assert (
        engine.request("Hi").controls == SamplingControls()
        and engine.request("Hi").logprobs is None
    )
    with pytest.raises(GenerationError, match="top_p must be a number in \\(0, 1\\], got 2"):
        engine.request("Hi", top_p=2)

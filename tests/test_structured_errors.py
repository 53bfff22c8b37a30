"""Structured output that fails for one row: a grammar that crashes the grammar library, one that
the library gives up on while decoding, a schema (or any field) nested too deep. Each becomes
that row's error; the process lives and the other rows are generated as they would be alone."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from dflash_batch.engine import load_engine
from dflash_batch.engine.grammar import Grammars

import pandas as pd
import pytest

from dflash_batch import checks, constraints
from dflash_batch.checks import BadValue
from dflash_batch.completion import Completion
from dflash_batch.request import Options, Request
from dflash_batch.runner.items import read_items
from dflash_batch.runner.spec import SpecError, load_spec
from tests.runner_fixtures import (  # noqa: F401
    REPO,
    cli,
    fake_models,
    home,
    wait_for,
    workers,
    write_jsonl,
)

OK_ROW = {"id": "ok", "prompt": "Say hi."}
BAD_REGEX = "((x{1000}){1000}){1000}"  # compiles; llguidance gives up at the first token


def chained_grammar(n: int) -> str:
    """A Lark grammar of ``n`` rules, each naming the next: 5,000 overflow llguidance's stack."""
    rules = "\n".join(f'r{i}: "t{i}" r{i + 1} | "u{i}"' for i in range(n))
    return f'start: r0\n{rules}\nr{n}: "end"\n'


def grammar_row(n: int) -> dict:
    grammar = {"type": "grammar", "grammar": chained_grammar(n)}
    return {"id": "g", "prompt": "hi", "response_format": grammar}


def deep_schema(levels: int) -> str:
    """A response_format whose schema nests ``levels`` arrays, as JSON text (json.dumps of one
    this deep would itself raise RecursionError)."""
    schema = '{"type": "array", "items": ' * levels + '{"type": "string"}' + "}" * levels
    return f'{{"type": "json_schema", "json_schema": {{"name": "deep", "schema": {schema}}}}}'


def fake_flags(models, *extra):
    return ["--target", models["target"], "--draft", models["draft"], *map(str, extra)]


def python(script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter: a crash there cannot take the test runner down."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO,
                          capture_output=True, text=True, timeout=240)  # fmt: skip


# -- a grammar that crashes llguidance (SIGSEGV) ---------------------------------------------------
def test_a_grammar_that_crashes_the_grammar_library_is_an_error_row(tmp_path, home, fake_models):
    src = write_jsonl(tmp_path / "seg.jsonl", [grammar_row(5000), OK_ROW])
    # `dflash-batch run` in a subprocess: a crash there cannot take the test runner down
    flags = fake_flags(fake_models, "--no-progress", "--output-dir", tmp_path / "out")
    out = cli("run", src, *flags, home=home, timeout=240)
    assert out.returncode == 5, (out.returncode, out.stderr[-2000:])
    rows = pd.read_parquet(tmp_path / "out").set_index("id")
    assert rows.loc["ok", "status"] == "ok"
    assert rows.loc["g", "status"] == "error"
    says = "line 1: 'response_format' cannot be compiled: the grammar library crashed on it"
    assert rows.loc["g", "error"].startswith(says), rows.loc["g", "error"]


def test_a_worker_lives_through_the_crashing_grammar(tmp_path, home, fake_models, workers):
    src = write_jsonl(tmp_path / "seg.jsonl", [grammar_row(5000), OK_ROW])
    job = cli("submit", src, *fake_flags(fake_models), "--name", "seg", home=home, check=True)
    job = job.stdout.split()[0]
    worker = workers()

    def finished():
        status = json.loads(cli("status", job, "--json", home=home, check=True).stdout)
        return status if status["state"] not in ("queued", "running") else None

    status = wait_for(finished, what="the job to finish")
    assert (status["state"], status["ok"], status["failed"]) == ("completed", 1, 1), status
    assert worker.proc.poll() is None, worker.log()[-2000:]


def test_the_engine_refuses_the_crashing_grammar_and_lives(tmp_path, tiny_pair):
    (tmp_path / "row.json").write_text(json.dumps(grammar_row(5000)))
    out = python(f"""
        import json
        from dflash_batch.completion import GenerationError
        from dflash_batch.engine import load_engine
        engine = load_engine({str(tiny_pair[0])!r}, draft=None, adaptive_block=False)
        row = json.load(open({str(tmp_path / "row.json")!r}))
        try:
            engine.request(row["prompt"], response_format=row["response_format"])
        except GenerationError as e:
            print("refused:", e)
        print("alive:", engine.generate("hi", max_tokens=2).finish_reason)
    """)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    says = "refused: response_format cannot be compiled: the grammar library crashed"
    assert says in out.stdout and "alive: length" in out.stdout, out.stdout


def test_a_crash_is_refused_again_from_the_cache_and_the_helper_comes_back(tmp_path):
    (tmp_path / "grammar.lark").write_text(chained_grammar(5000))
    out = python(f"""
        from dflash_batch import constraints
        crashing = {{"type": "grammar", "grammar": open({str(tmp_path / "grammar.lark")!r}).read()}}
        for _ in range(2):
            try:
                constraints.grammar(crashing)
            except ValueError as e:
                print("refused:", e)
        print("helper:", constraints._HELPER.proc)
        print("next:", bool(constraints.grammar({{"type": "regex", "regex": "[a-z]{{1,3}}"}})))
        print("helper:", constraints._HELPER.proc is not None)
    """)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["refused", "refused"], lines
    assert "crashed on it" in lines[1]
    assert lines[2] == "helper: None"  # the second refusal came from the cache: no helper started
    assert lines[3:] == ["next: True", "helper: True"]  # a new helper served the next grammar
    too_long = {"type": "regex", "regex": "a" * (constraints.MAX_CHARS + 1)}
    with pytest.raises(BadValue, match=f"at most {constraints.MAX_CHARS}"):
        constraints.grammar(too_long)


# -- a grammar that fails while decoding ---------------------------------------------------------
def test_one_rows_failing_regex_is_its_error_and_the_job_goes_on(tmp_path, home, tiny_pair):
    rows = [
        {"id": "ok1", "prompt": "Say hi."},
        {"id": "re", "prompt": "Say x.", "response_format": {"type": "regex", "regex": BAD_REGEX}},
        {"id": "ok2", "prompt": "Say bye."},
    ]
    flags = ["--target", tiny_pair[0], "--draft", tiny_pair[1], "--no-progress", "--max-tokens", 4]
    out = cli("run", write_jsonl(tmp_path / "re.jsonl", rows), *flags, "--output-dir",
              tmp_path / "out", home=home, timeout=240)  # fmt: skip
    assert out.returncode == 5, (out.returncode, out.stderr[-2000:])
    got = pd.read_parquet(tmp_path / "out").set_index("id")
    assert got.loc["ok1", "status"] == got.loc["ok2", "status"] == "ok"
    assert got.loc["ok1", "completion_tokens"] == got.loc["ok2", "completion_tokens"] == 4
    assert got.loc["re", "status"] == "error"
    error = got.loc["re", "error"]
    assert error.startswith("line 2: RuntimeError: response_format: the grammar library refused")
    assert "too many expressions constructed" in error and "<state>" not in error  # no state dump


FAILING = "[a-z ]{1,60}"  # the grammar of the row whose matcher the tests make fail
OTHER = "[A-Z][a-z ]{1,60}"
PROMPTS = [("a", "Tell me a story.", None), ("b", "Say x.", FAILING), ("c", "Name a city.", OTHER),
           ("d", "Count to ten.", None)]  # fmt: skip


def regex(pattern):
    return {"type": "regex", "regex": pattern} if pattern else None


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return load_engine(str(tiny_pair[0]), str(tiny_pair[1]), adaptive_block=False)


def solo(engine, prompt, pattern):
    return engine.generate(prompt, max_tokens=12, response_format=regex(pattern)).token_ids


def batched(engine):
    options = {i: Options(max_tokens=12, response_format=regex(g)) for i, _, g in PROMPTS}
    requests = [Request(i, p, options[i]) for i, p, _ in PROMPTS]
    return {req.id: out for req, out in engine.generate_requests(requests, batch_size=4)}


def fail_matchers(monkeypatch, at: str, calls: int = 1):
    """The matchers of the FAILING grammar raise: when built (``at="build"``) or on their
    ``calls``-th commit (``at="commit"``, mid-decode); every other matcher is untouched."""
    failing, counts = set(), {}
    build, commit = Grammars.matcher, Grammars.commit

    def matcher(self, grammar):
        if at == "build" and grammar == constraints.grammar(regex(FAILING)):
            raise ValueError("injected: cannot build")
        m = build(self, grammar)
        if grammar == constraints.grammar(regex(FAILING)):
            failing.add(id(m))
        return m

    def committed(m, tokens):
        if id(m) in failing:
            counts[id(m)] = counts.get(id(m), 0) + 1
            if counts[id(m)] >= calls:
                raise RuntimeError("injected: grammar failed mid-decode")
        commit(m, tokens)

    monkeypatch.setattr(Grammars, "matcher", matcher)
    monkeypatch.setattr(Grammars, "commit", staticmethod(committed))


FAILURES = [("commit", 3, "mid-decode"), ("build", 1, "cannot build")]


@pytest.mark.parametrize("at, calls, says", FAILURES)
def test_a_row_whose_grammar_fails_is_its_error_the_others_lossless(engine, monkeypatch, at, calls,
                                                                     says):  # fmt: skip
    expected = {i: solo(engine, p, g) for i, p, g in PROMPTS if g != FAILING}
    fail_matchers(monkeypatch, at, calls)
    out = batched(engine)
    assert isinstance(out["b"], RuntimeError if at == "commit" else ValueError)
    assert says in str(out["b"])
    for i, tokens in expected.items():  # the other rows, constrained or not, as they are alone
        assert isinstance(out[i], Completion) and out[i].token_ids == tokens, i
    prompts = [p for _, p, _ in PROMPTS]
    with pytest.raises(Exception, match=says):  # a call that yields only completions raises it
        engine.generate_batch(prompts, max_tokens=12, response_format=regex(FAILING))


# -- nested too deep -------------------------------------------------------------------------------
def test_a_schema_nested_too_deep_is_the_rows_error_naming_the_field(tmp_path):
    assert constraints.grammar(json.loads(deep_schema(60)))  # a deep but usual schema compiles
    rows = [f'{{"id": "d{n}", "prompt": "hi", "response_format": {deep_schema(n)}}}'
            for n in (400, 990)]  # fmt: skip
    items = list(read_items(write_jsonl(tmp_path / "deep.jsonl", rows)))
    assert len(items) == 2
    for item in items:
        assert item.error == (f"{item.where}: 'response_format' nests deeper than "
                              f"{checks.MAX_NESTING} levels of lists and objects")  # fmt: skip
    loop = []
    loop.append(loop)  # what a YAML alias that contains itself loads as
    with pytest.raises(BadValue, match="nests deeper"):
        checks.nesting(loop)
    deep = {"a": 1}
    for _ in range(990):
        deep = {"a": deep}
    spec = {"input": str(tmp_path / "deep.jsonl"), "chat_template_kwargs": deep}
    with pytest.raises(SpecError, match="chat_template_kwargs.*nests deeper"):
        load_spec(spec)


def test_any_field_nested_too_deep_is_refused_naming_it(tmp_path, home, fake_models):
    deep = "[" * 300 + "]" * 300  # json reads it; orjson would not write it back (255 levels)
    chat = '[{"role": "user", "content": "hi"}]'
    rows = [f'{{"id": "m", "prompt": "hi", "metadata": {{"a": {deep}}}}}',
            f'{{"custom_id": "o", "body": {{"messages": {chat}, "x": {deep}}}}}',
            OK_ROW]  # fmt: skip
    flags = fake_flags(fake_models, "--no-progress")
    out = cli("run", write_jsonl(tmp_path / "deep.jsonl", rows), *flags, "--output-dir",
              tmp_path / "out", home=home)  # fmt: skip
    assert out.returncode == 5, out.stderr[-2000:]
    got = pd.read_parquet(tmp_path / "out").set_index("id")
    assert got.loc["ok", "status"] == "ok"
    too_deep = "nests deeper than 100 levels of lists and objects"
    assert got.loc["m", "error"] == f"line 1: 'metadata' {too_deep}"
    assert got.loc["o", "error"] == f"line 2: 'body' {too_deep}"
    nested = "[" * 5000 + "]" * 5000  # beyond what json and PyYAML can read
    flag = cli("run", tmp_path / "deep.jsonl", *flags, "--response-format", nested, home=home)
    assert flag.returncode == 2, flag.stderr
    assert "--response-format: nests too deeply to read" in flag.stderr
    yaml = f"input: deep.jsonl\nchat_template_kwargs: {{a: {nested}}}\n"
    (tmp_path / "deep.yaml").write_text(yaml)
    spec = cli("run", tmp_path / "deep.yaml", *flags, home=home)
    assert spec.returncode == 2, spec.stderr
    assert "deep.yaml: invalid YAML: nests too deeply to read" in spec.stderr
    jobs = json.loads(cli("status", "--json", home=home, check=True).stdout)
    assert len(jobs) == 1  # the refused commands left no job record: only the first run's

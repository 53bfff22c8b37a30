"""Drafter training data at scale: the offline corpus, the token-id store, generation into it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from dflash_batch.engine import Engine
from dflash_batch.engine.models import loading

import mlx.core as mx
import numpy as np
import pytest

from dflash_batch.training import cli, corpus
from dflash_batch.training import generate as gen
from dflash_batch.training import store as store_mod
from dflash_batch.training.store import AnswerStore, prompt_key
from dflash_batch.training.trainer import (
    TrainConfig,
    all_prompts,
    answer_samples,
    chat_pieces,
    prompt_order,
)
from tests import synthetic

ROOT = Path(__file__).resolve().parent.parent


# -- the offline corpus ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_corpus():
    return corpus.build_corpus(60000, seed=0, eval_percent=3)


def test_corpus_has_50k_distinct_training_prompts(big_corpus):
    train = [p for p in big_corpus if p["split"] == "train"]
    assert len(train) >= 50000
    texts = [corpus.prompt_text(p) for p in big_corpus]
    assert len(set(texts)) == len(texts)  # distinct
    assert len({p["id"] for p in big_corpus}) == len(big_corpus)
    kinds = Counter(p["kind"] for p in big_corpus)
    assert kinds["passage"] > 10000 and kinds["code"] > 10000 and kinds["summary"] > 0
    sources = Counter(p["source"].split(":")[0] for p in big_corpus)
    assert set(sources) == {"stdlib", "pydoc", "template"}


def test_no_held_out_prompt_or_source_in_training(big_corpus):
    train = [p for p in big_corpus if p["split"] == "train"]
    held = [p for p in big_corpus if p["split"] == "eval"]
    assert len(held) >= 200
    assert not {p["source"] for p in train} & {p["source"] for p in held}
    assert not {corpus.prompt_text(p) for p in train} & {corpus.prompt_text(p) for p in held}
    # No held-out passage or code body reaches training under another task either.
    body = lambda p: corpus.prompt_text(p).split("\n\n", 1)[-1]  # noqa: E731
    assert not {body(p) for p in train} & {body(p) for p in held}
    # The rule is the source's name alone: a held-out source of this corpus is held out in any.
    assert all(corpus.is_held_out(p["source"], 3) == (p["split"] == "eval") for p in big_corpus)


def _fake_stdlib(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    doc = "Return the frobnicated value of x.\n\nThe value is frobnicated twice, then clamped to the range of the widget so that callers never see a value outside it. "
    for i in range(6):
        (root / f"mod{i}.py").write_text(
            f'"""Module {i}: {doc * 2}"""\n\n'
            + "".join(
                f'def f{i}_{j}(x):\n    """{doc}{j}"""\n    y = x + {j}\n    y = y * 2\n    return max(0, min(y, {i}))\n\n'
                for j in range(4)
            )
        )
    (root / "test" / "test_mod.py").write_text(
        'def test_x():\n    """Never read: tests are left out. '
        + doc
        + '"""\n    a = 1\n    b = 2\n    c = 3\n    return a\n'
    )
    (root / "pkg" / "broken.py").write_text("def (:\n")  # unparsable: skipped
    return root


def test_corpus_is_deterministic_and_skips_tests(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    a = corpus.build_corpus(120, seed=1, stdlib_root=root)
    b = corpus.build_corpus(120, seed=1, stdlib_root=root)
    c = corpus.build_corpus(120, seed=2, stdlib_root=root)
    assert a == b and a != c and len(a) == 120
    assert not any("test_x" in corpus.prompt_text(p) or "test/" in p["source"] for p in a)
    code = [p for p in a if p["kind"] == "code" and p["source"].startswith("stdlib:")]
    assert code and all("```python\ndef f" in corpus.prompt_text(p) for p in code)


# -- the store -------------------------------------------------------------------------------
def test_store_round_trip_dedupe_and_torn_tail(tmp_path):
    st = AnswerStore(tmp_path / "s", vocab_size=70000)
    assert st.dtype == np.dtype("<u4")
    with st.open_writer() as w:
        w.append(1, 0, [5, 69999, 0], True, 0.0)
        w.append(1, 1, [], False, 0.7)
    with st.open_writer() as w:  # a second run: a shard of its own
        w.append(1, 0, [9, 9], False, 0.0)  # the same (key, sample) again: the first one counts
        w.append(2, 0, [3], True, 0.0)
    assert [p.name for p in st.shards()] == ["shard-00000.bin", "shard-00001.bin"]
    got = st.answers()
    assert got[(1, 0)].tokens == [5, 69999, 0] and got[(1, 0)].ended
    assert got[(1, 1)].tokens == [] and got[(1, 1)].temperature == 0.7
    assert set(got) == {(1, 0), (1, 1), (2, 0)}
    # A crash mid-record leaves a torn tail: readers ignore it, the next writer cuts it.
    shard = st.shards()[-1]
    whole = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(store_mod.HEADER.pack(store_mod.MAGIC, 7, 0, 50, 0, 0, 0)[:20])
    assert set(AnswerStore(tmp_path / "s").answers()) == {(1, 0), (1, 1), (2, 0)}
    AnswerStore(tmp_path / "s").open_writer().close()
    assert shard.stat().st_size == whole
    # A damaged record (a flipped token byte) fails its CRC: that record and the rest of the shard are dropped.
    blob = bytearray(shard.read_bytes())
    blob[-1] ^= 0xFF
    shard.write_bytes(bytes(blob))
    assert (2, 0) not in AnswerStore(tmp_path / "s").answers()


def test_store_is_compact_and_checks_ids(tmp_path):
    st = AnswerStore(tmp_path / "s", vocab_size=49152)
    assert st.dtype == np.dtype("<u2")
    with st.open_writer() as w:
        w.append(3, 0, list(range(100)), True, 0.0)
        with pytest.raises(ValueError, match="out of range"):
            w.append(3, 1, [70000], True, 0.0)
    assert st.shards()[0].stat().st_size == store_mod.HEADER.size + 200  # 2 bytes a token
    with pytest.raises(FileNotFoundError):
        AnswerStore(tmp_path / "none")


# -- generation through the batched engine ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data") / "target"
    return synthetic.save_target(folder, synthetic.tiny_llama_config(layers=4), seed=3)


def _engine(folder, eos):
    model, tok, config = loading.load_target(folder)
    return Engine(model, gen.IdsTokenizer(eos), None, config=config)


def _prompts(folder, n):
    tok = loading.load_target(folder)[1]
    texts = [f"Tell me about item {i} and why it matters." for i in range(n)]
    out = []
    for t in texts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True
        )
        out.append({"key": prompt_key(ids), "prompt": [int(x) for x in ids]})
    return out, sorted(tok.eos_token_ids)


def test_greedy_answers_equal_the_targets_own_greedy(tiny, tmp_path):
    from mlx_lm import load as mlx_load
    from mlx_lm.generate import generate_step

    prompts, eos = _prompts(tiny, 3)
    st = AnswerStore(tmp_path / "a", vocab_size=512)
    got = gen.generate_to_store(
        _engine(tiny, eos), prompts, st, samples=range(2), max_tokens=16, batch_size=4
    )
    assert got == {"written": 6, "tokens": got["tokens"], "left": 0, "skipped": 0}
    model, _ = mlx_load(str(tiny))
    answers = st.answers()
    for p in prompts:
        ref = []
        for t, _ in generate_step(mx.array(p["prompt"]), model, max_tokens=16):
            if int(t) in eos:
                break
            ref.append(int(t))
        assert answers[(p["key"], 0)].tokens == ref
        assert answers[(p["key"], 1)].tokens != ref  # the sampled answer is another one
        assert answers[(p["key"], 1)].temperature == 0.7


def test_sampled_answers_follow_the_target_distribution(tiny, tmp_path):
    """First tokens of stored sampled answers against softmax(logits / T) of the target: a
    chi-square test that passes at the temperature used and fails at another (the control)."""
    prompts, eos = _prompts(tiny, 1)
    p = prompts[0]
    st = AnswerStore(tmp_path / "a", vocab_size=512)
    n, temp = 1500, 0.7
    gen.generate_to_store(
        _engine(tiny, eos),
        prompts,
        st,
        samples=range(1, n + 1),
        temperature=temp,
        max_tokens=1,
        batch_size=64,
    )
    firsts = Counter(r.tokens[0] if r.tokens else eos[0] for r in st.records())
    model = loading.load_target(tiny)[0]
    logits = model(mx.array(p["prompt"])[None])[0, -1].astype(mx.float32)

    def chi2(t):
        probs = np.array(mx.softmax(logits / t))
        top = np.argsort(-probs)[:8]
        expected = np.append(probs[top], 1 - probs[top].sum()) * n
        seen = np.array([firsts[int(i)] for i in top] + [n - sum(firsts[int(i)] for i in top)])
        return float(((seen - expected) ** 2 / expected).sum())

    critical = 27.9  # chi-square, 8 degrees of freedom, p = 0.0005
    assert chi2(temp) < critical
    assert chi2(2.0) > critical  # negative control: the wrong temperature is detected


def test_killed_generation_resumes_without_duplicates_or_loss(tiny, tmp_path):
    """SIGKILL a generating process mid-run (and leave a torn record), resume: every answer is
    stored exactly once and equals the uninterrupted run's."""
    folder = tmp_path / "answers"
    script = f"""
import sys, json
sys.path.insert(0, {str(ROOT)!r})
from dflash_batch.engine import Engine
from dflash_batch.engine.models import loading
from dflash_batch.training import generate as gen
from dflash_batch.training.store import AnswerStore
prompts, eos = json.load(open({str(tmp_path / "prompts.json")!r}))
model, tok, config = loading.load_target({str(tiny)!r})
engine = Engine(model, gen.IdsTokenizer(eos), None, config=config)
gen.generate_to_store(engine, prompts, AnswerStore({str(folder)!r}, 512), range(2), 0.7, 24, window=4, batch_size=2)
"""
    prompts, eos = _prompts(tiny, 24)
    (tmp_path / "prompts.json").write_text(json.dumps([prompts, eos]))
    AnswerStore(folder, 512)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        shards = list(folder.glob("shard-*.bin"))
        if shards and shards[0].stat().st_size > 600:  # some records are in
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    st = AnswerStore(folder)
    before = len(st.done())
    assert 0 < before < 48, "the kill should land mid-run"
    with st.shards()[0].open("ab") as f:
        f.write(b"DFA1\x01\x02")  # a torn record, as a kill mid-write leaves
    got = gen.generate_to_store(
        _engine(tiny, eos), prompts, st, range(2), 0.7, 24, window=4, batch_size=2
    )
    assert got["written"] == 48 - before and got["left"] == 0
    raw = [r for shard in st.shards() for r in store_mod._scan(shard, st.dtype)[0]]
    assert len(raw) == 48 and len({(r.key, r.sample) for r in raw}) == 48  # no duplicates, no loss
    ref = AnswerStore(tmp_path / "ref", 512)
    gen.generate_to_store(
        _engine(tiny, eos), prompts, ref, range(2), 0.7, 24, window=4, batch_size=2
    )
    mine, theirs = st.answers(), ref.answers()
    assert {k: v.tokens for k, v in mine.items()} == {k: v.tokens for k, v in theirs.items()}


def test_time_budget_stops_and_resumes(tiny, tmp_path):
    prompts, eos = _prompts(tiny, 6)
    st = AnswerStore(tmp_path / "a", 512)
    got = gen.generate_to_store(
        _engine(tiny, eos), prompts, st, range(1), max_tokens=8, deadline=time.perf_counter()
    )
    assert got == {"written": 0, "tokens": 0, "left": 6, "skipped": 0} and not st.shards()
    got = gen.generate_to_store(
        _engine(tiny, eos), prompts, st, range(1), max_tokens=8, window=2, batch_size=2
    )
    assert got["left"] == 0 and len(st.done()) == 6


# -- the target's own user turns -------------------------------------------------------------
def test_self_written_user_turns(tiny, tmp_path):
    tok = loading.load_target(tiny)[1]
    chat = chat_pieces(tok)
    # A turn spliced in as ids is exactly the template's encoding of the conversation.
    text = "How do tides work?"
    turn = tok.encode(text, add_special_tokens=False)
    assert gen.turn_prompt(chat, turn) == list(
        tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
    )
    eos = set(tok.eos_token_ids) | set(chat["turn_suffix"][:1])
    st = AnswerStore(tmp_path / "turns", 512)
    got = gen.sample_user_turns(_engine(tiny, eos), chat, st, 40, max_tokens=12, batch_size=8)
    assert got["written"] == 40
    # Filters: ended on its own, long enough, no special ids, not a loop; duplicates once.
    with st.open_writer() as w:
        key = prompt_key(chat["user_header"])
        w.append(key, 41, turn, True, 1.0)
        w.append(key, 42, turn, True, 1.0)  # a duplicate
        w.append(key, 43, turn, False, 1.0)  # cut by the budget
        w.append(key, 44, [turn[0]] * 12, True, 1.0)  # a loop
        w.append(key, 45, turn + [chat["special_ids"][0]], True, 1.0)
    made = gen.self_prompts(st, chat, chat["special_ids"])
    ids = [tuple(p["prompt"]) for p in made]
    assert len(ids) == len(set(ids)) and tuple(gen.turn_prompt(chat, turn)) in ids
    assert not any(
        tuple(gen.turn_prompt(chat, t)) in ids
        for t in ([turn[0]] * 12, turn + [chat["special_ids"][0]])
    )
    assert all(
        p["source"].startswith("self:") and p["key"] == prompt_key(p["prompt"]) for p in made
    )
    # Held out by source (the turn): 40 distinct turns at 25 % put some on each side.
    with st.open_writer() as w:
        for i in range(40):
            w.append(
                key,
                100 + i,
                turn + tok.encode(f" number {i} please", add_special_tokens=False),
                True,
                1.0,
            )
    made = gen.self_prompts(st, chat, chat["special_ids"], eval_percent=25)
    assert {p["split"] for p in made} == {"train", "eval"}
    assert all((p["split"] == "eval") == corpus.is_held_out(p["source"], 25) for p in made)


def test_held_out_self_written_prompts_come_after_the_encoded_ones():
    # So an evaluation of the first N held-out answers reads the same ones as turns are added.
    made = [dict(kind=kind, split=split, key=key) for kind, split, key in (
        ("self", "eval", 1), ("code", "eval", 5), ("self", "train", 0), ("passage", "train", 3), ("passage", "eval", 9))]  # fmt: skip
    ordered = [(p["kind"], p["key"]) for p in sorted(made, key=prompt_order)]
    assert ordered == [("code", 5), ("passage", 9), ("self", 1), ("self", 0), ("passage", 3)]


# -- train-drafter on the store ----------------------------------------------------------------
def test_train_drafter_generates_resumes_and_trains_from_the_store(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    base = ["--target", str(tiny), "--out", str(out), "--prompts", "12", "--eval-percent", "25", "--max-answer-tokens", "12",
            "--gen-batch", "8", "--samples", "1", "--self-prompts", "6"]  # fmt: skip
    assert (
        cli.main(base + ["--generate-only", "--gen-time-budget", "1e-9"]) == 3
    )  # budget spent: some left
    assert cli.main(base + ["--generate-only"]) == 0
    data = out / "data"
    meta = json.loads((data / "meta.json").read_text())
    assert meta["vocab_size"] == 512 and meta["answer_eos_id"] in meta["eos_token_ids"]
    cfg = TrainConfig(out=str(out), samples=1, self_prompts=6, eval_percent=25)
    stored, train, held = answer_samples(cfg)
    assert stored == len(train) + len(held) and held and {s["sample"] for s in train} == {0, 1}
    assert any(s["kind"] == "self" for s in train + held)
    # Self-written prompts are held out by their source too; no held-out prompt is trained on.
    made = [p for p in all_prompts(cfg, meta) if p["kind"] == "self"]
    assert made and all((p["split"] == "eval") == corpus.is_held_out(p["source"], 25) for p in made)
    assert not {tuple(s["prompt"]) for s in train} & {tuple(s["prompt"]) for s in held}
    # Generating again adds nothing: every answer is stored.
    before = sum(p.stat().st_size for p in (data / "answers").glob("shard-*"))
    assert cli.main(base + ["--generate-only"]) == 0
    assert sum(p.stat().st_size for p in (data / "answers").glob("shard-*")) == before
    capsys.readouterr()
    train_args = ["--steps", "2", "--batch-size", "4", "--anchors", "4", "--max-len", "96", "--layers", "1", "--taps", "2",
                  "--warmup", "1", "--log-every", "1", "--eval-every", "2", "--train-only", "--max-answers", "10"]  # fmt: skip
    assert cli.main(base + train_args) == 0
    err = capsys.readouterr().err
    assert "training on 10 sequences" in err and (out / "drafter" / "config.json").exists()


def test_sweep_trains_each_configuration_once_and_writes_the_curve(tiny, tmp_path):
    from dflash_batch.training import sweep

    out = tmp_path / "run"
    base = ["--target", str(tiny), "--out", str(out), "--prompts", "16", "--eval-percent", "25", "--max-answer-tokens", "12",
            "--gen-batch", "8", "--samples", "1"]  # fmt: skip
    assert cli.main(base + ["--generate-only"]) == 0
    args = ["--target", str(tiny), "--data", str(out / "data"), "--out", str(tmp_path / "sweep"), "--answers", "6,12",
            "--layers", "1", "--blocks", "4", "--steps", "2", "--samples", "1", "--eval-percent", "25", "--taps", "2",
            "--batch-size", "2", "--anchors", "2", "--max-len", "64", "--warmup", "1", "--decode-prompts", "3",
            "--decode-tokens", "8"]  # fmt: skip
    assert sweep.main(args + ["--call-budget", "1"]) == 3  # no time for any run: both left
    assert sweep.main(args) == 0
    rows = [
        json.loads(line) for line in (tmp_path / "sweep" / "curve.jsonl").read_text().splitlines()
    ]
    assert [(r["answers"], r["layers"], r["block_size"], r["steps"]) for r in rows] == [
        (6, 1, 4, 2),
        (12, 1, 4, 2),
    ]
    assert (
        all(0 < r["final_eval"]["tau"] for r in rows)
        and "| 6 |" in (tmp_path / "sweep" / "curve.md").read_text()
    )
    assert all(
        1 <= r["decode"]["prompts"] <= 3
        and r["decode"]["cycles"] > 0
        and r["decode"]["tokens_per_cycle"] >= 1
        for r in rows
    )
    logs = sorted((tmp_path / "sweep").glob("*/train.log.jsonl"))
    stamps = [p.stat().st_mtime_ns for p in logs]
    assert sweep.main(args) == 0  # a finished run is not trained again
    assert [p.stat().st_mtime_ns for p in logs] == stamps
    assert sweep.configurations([5, 50], [2, 4], [8, 16], False) == [
        (5, 4, 16),
        (50, 2, 16),
        (50, 4, 8),
        (50, 4, 16),
    ]


def test_a_prompt_the_engine_refuses_is_skipped_and_named(tiny, tmp_path):
    prompts, eos = _prompts(tiny, 2)
    engine = _engine(tiny, eos)
    long = [5] * engine.max_context  # as long as the target's context: refused
    prompts.append({"id": "too-long", "key": prompt_key(long), "prompt": long})
    said = []
    got = gen.generate_to_store(
        engine, prompts, AnswerStore(tmp_path / "a", 512), [0], max_tokens=4, log=said.append
    )
    assert got["written"] == 2 and got["skipped"] == 1 and got["left"] == 0
    assert any("too-long" in s and "context" in s for s in said)


def test_generation_with_a_drafter_stores_the_same_greedy_answers(tiny_pair, tmp_path):
    from dflash_batch.training.trainer import generation_engine

    target, drafter = tiny_pair
    prompts, eos = _prompts(target, 3)
    model, _, config = loading.load_target(target)
    stores = {}
    for name, path in (("plain", None), ("dflash", str(drafter))):
        engine = generation_engine(
            TrainConfig(out=str(tmp_path), gen_drafter=path), model, config, eos
        )
        assert (engine.drafter is None) == (path is None)
        stores[name] = AnswerStore(tmp_path / name, 512)
        gen.generate_to_store(engine, prompts, stores[name], [0], max_tokens=20, batch_size=3)
    plain, dflash = ({k: r.tokens for k, r in s.answers().items()} for s in stores.values())
    assert plain == dflash and len(plain) == 3


@pytest.mark.parametrize(
    "flag, value", [("--samples", "-1"), ("--sample-temperature", "0"), ("--gen-time-budget", "-5")]
)
def test_bad_data_flags_are_refused_by_name(tmp_path, capsys, flag, value):
    assert cli.main(["--out", str(tmp_path / "r"), "--generate-only", flag, value]) == 2
    assert flag in capsys.readouterr().err and not (tmp_path / "r").exists()

"""The embedded default pair: SmolLM2-135M-Instruct (GGUF) + the drafter shipped in the package."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_batch.engine import load_drafter, load_engine
from dflash_batch.engine.models import default_model, registry

import mlx.core as mx
import pytest

PROMPTS = [
    "What is 25 + 17?",
    "Summarize in one sentence: The water cycle moves water between the oceans, the air and the land.",
    "Write a Python function that reverses a string.",
]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A fresh model cache ($DFLASH_BATCH_CACHE): the conversion runs as on a first install."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("dflash-cache")
    mp.setenv(default_model.CACHE_ENV, str(path))
    yield path
    mp.undo()


def test_model_cache_is_apart_from_the_job_home(tmp_path, monkeypatch):
    """--home / $DFLASH_BATCH_HOME hold job state only: a job home of its own does not convert the
    model again. The cache follows $DFLASH_BATCH_CACHE, else the platform's cache folder."""
    from dflash_batch.cli import main

    monkeypatch.delenv(default_model.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("DFLASH_BATCH_HOME", str(tmp_path / "jobs-home"))
    expected = (
        tmp_path / "xdg" / "dflash-batch"
        if sys.platform != "darwin"
        else Path.home() / "Library" / "Caches" / "dflash-batch"
    )
    assert default_model.cache_dir() == expected
    assert (
        main(["--home", str(tmp_path / "other-home"), "status"]) == 0
    )  # --home sets $DFLASH_BATCH_HOME
    assert default_model.cache_dir() == expected
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    if sys.platform != "darwin":
        assert default_model.cache_dir() == tmp_path / "user" / ".cache" / "dflash-batch"
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path / "cache"))
    assert default_model.cache_dir() == tmp_path / "cache"


@pytest.fixture(scope="module")
def engines(home):
    return load_engine(), load_engine(draft=None)


def test_shipped_drafter_fits_and_matches_the_target():
    asset = default_model.DRAFTER_ASSET
    size = sum(f.stat().st_size for f in asset.iterdir())
    assert size <= 20 * 1024 * 1024
    config = json.loads((asset / "config.json").read_text())
    dflash = config["dflash_config"]
    assert dflash["block_size"] == 16 and max(dflash["target_layer_ids"]) < 30
    # The mask id is a control token of the GGUF vocabulary (never produced from ordinary text).
    _, meta = mx.load(str(default_model.gguf_path()), return_metadata=True)
    assert meta["tokenizer.ggml.token_type"][dflash["mask_token_id"]].item() == 3
    assert meta["tokenizer.ggml.tokens"][dflash["mask_token_id"]] == "<empty_output>"
    assert (asset / "README.md").exists() and not (
        asset / "TRAINING.md"
    ).exists()  # the diary: docs/results
    vocab = json.loads((asset / "draft_vocab.json").read_text())["token_ids"]
    assert (
        len(vocab) == 16384 and vocab == sorted(set(vocab)) and 2 in vocab
    )  # 2: <|im_end|>, the EOS


def test_default_pair_is_lossless_and_accepts(engines):
    dflash, plain = engines
    assert dflash.drafter is not None and dflash.block_size == 16 and plain.drafter is None
    assert (
        dflash.description["draft_vocab"] == 16384
    )  # the shipped draft vocabulary, through the cache's copy
    assert dflash.target.embed_tokens.weight.dtype == mx.float32
    # The drafter's own acceptance is read at a fixed width (the whole block every cycle): the
    # adaptive width follows timed pass costs, so its tokens per cycle move with machine load.
    full = load_engine(adaptive_block=False)
    cycles = generated = 0
    for text in PROMPTS:
        a = dflash.generate(text, max_tokens=48)
        b = plain.generate(text, max_tokens=48)
        c = full.generate(text, max_tokens=48)
        assert a.token_ids == b.token_ids == c.token_ids and a.text == b.text
        cycles += c.stats.cycles
        generated += c.stats.generated_tokens - 1  # the prefill's token is not a cycle's
    # A trained drafter: on average more than one token per verify cycle is committed.
    assert generated / cycles > 1.5


def test_cache_layout_and_pairing(home, engines):
    target, drafter = default_model.ensure_default_pair()
    assert target.startswith(str(home)) and drafter.startswith(str(home))
    assert default_model.ensure_default_pair() == (target, drafter)  # converted once
    assert not [
        p for p in (home / "models").iterdir() if p.name.startswith(".")
    ]  # no temp folders left
    assert registry.registered_drafter(target) == (drafter, None)  # via dflash_drafter.json
    assert "quantization" not in json.loads(
        (default_model.Path(drafter) / "config.json").read_text()
    )


def test_named_target_gets_its_registered_drafter(home, engines):
    assert registry.registered_drafter("HuggingFaceTB/SmolLM2-135M-Instruct")[0] == str(
        default_model.ensure_drafter()
    )
    engine = load_engine(str(default_model.gguf_path()))  # the GGUF file itself, no drafter named
    assert engine.drafter is not None
    text = PROMPTS[0]
    assert (
        engine.generate(text, max_tokens=24).token_ids
        == engines[1].generate(text, max_tokens=24).token_ids
    )


def test_dequantized_copy_matches_the_shipped_drafter(home):
    shipped = load_drafter(default_model.DRAFTER_ASSET, dtype=mx.float32)
    plain = load_drafter(default_model.ensure_drafter())
    mx.random.seed(0)
    x, ctx = mx.random.normal((1, 16, 576)), mx.random.normal((1, 7, 576 * 5))
    a = shipped(x, ctx, shipped.make_cache())
    b = plain(x, ctx, plain.make_cache())
    assert mx.allclose(a, b, atol=1e-3).item()

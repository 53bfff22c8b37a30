"""Draft vocabularies (engine/decode.py: ``DraftHead``): a drafter that drafts only from the
tokens the target writes most. The head's cut rows must give the whole head's logits at those
tokens, every draft must lie in the vocabulary, and output must stay the target's own greedy
output, batched or not."""

from __future__ import annotations

import json
import shutil

from dflash_batch.engine import decode, load_engine
from dflash_batch.engine.models import loading
from dflash_batch.engine.models.target import Target

import mlx.core as mx
import mlx.nn as nn
import pytest

from dflash_batch.errors import ModelMismatchError
from dflash_batch.training import export
from tests.helpers import PROMPTS, greedy_reference

VOCAB = list(range(0, 512, 3)) + [7, 11]  # 173 of the tiny targets' 512 tokens


def with_vocab(src, dst, ids):
    shutil.copytree(src, dst)
    (dst / "draft_vocab.json").write_text(json.dumps({"token_ids": ids}))
    return dst


@pytest.mark.parametrize(
    "target", ["qwen3_target", "llama_target"]
)  # tied embedding, separate lm_head
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_cut_head_gives_the_whole_heads_logits_at_its_rows(target, bits, request):
    model, _, _ = loading.load_target(request.getfixturevalue(target), dtype=mx.float32)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    t = Target(model)
    ids = mx.array(VOCAB, dtype=mx.int32)
    mx.random.seed(3)
    h = mx.random.normal((2, 5, t.hidden_size))
    whole = t.lm_head(h)
    cut = t.head_rows(ids)(h)
    assert cut.shape == (2, 5, len(VOCAB))
    assert mx.allclose(cut, whole[..., ids], atol=1e-4, rtol=1e-4).item()
    head = decode.DraftHead(t, VOCAB)
    picked = head(h)
    assert (picked == ids[mx.argmax(whole[..., ids], axis=-1)]).all().item()
    assert set(picked.flatten().tolist()) <= set(VOCAB)


def test_drafts_come_from_the_vocabulary_and_output_is_unchanged(tiny_pair, tmp_path, monkeypatch):
    target_dir, draft_dir = tiny_pair
    drafter = with_vocab(draft_dir, tmp_path / "drafter", VOCAB)
    engine = load_engine(str(target_dir), str(drafter), adaptive_block=False)
    assert engine.draft_head is not None and len(engine.draft_head) == len(VOCAB)
    assert engine.description["draft_vocab"] == len(VOCAB)
    drafted = []
    call = decode.DraftHead.__call__

    def spy(self, h):
        out = call(self, h)
        drafted.extend(out.flatten().tolist())
        return out

    monkeypatch.setattr(decode.DraftHead, "__call__", spy)
    prompts = [engine.encode(p) for p in PROMPTS]
    for ids in prompts[:3]:
        assert engine.generate(ids, max_tokens=40).token_ids == greedy_reference(
            target_dir, ids, 40, engine.tokenizer.eos_token_ids
        )
    for ids, out in zip(prompts, engine.generate_batch(prompts, max_tokens=40, batch_size=4)):
        assert out.token_ids == greedy_reference(
            target_dir, ids, 40, engine.tokenizer.eos_token_ids
        )
    assert drafted and set(drafted) <= set(VOCAB)


def test_a_drafter_without_a_vocabulary_drafts_from_every_token(tiny_pair):
    engine = load_engine(*map(str, tiny_pair))
    assert engine.draft_head is None and engine.description["draft_vocab"] is None


@pytest.mark.parametrize(
    "content, error",
    [
        ("not json", "expected"),
        (json.dumps({"ids": [1, 2]}), "expected"),
        (json.dumps({"token_ids": []}), "non-empty"),
        (json.dumps({"token_ids": [1, "2"]}), "integers"),
        (json.dumps({"token_ids": [1, 2, 2]}), "repeat"),
        (json.dumps({"token_ids": [1, 512]}), "outside the vocabulary"),
        (json.dumps({"token_ids": [-1, 2]}), "outside the vocabulary"),
    ],
)
def test_a_bad_vocabulary_file_is_a_clear_error(tiny_pair, tmp_path, content, error):
    drafter = shutil.copytree(tiny_pair[1], tmp_path / "drafter")
    (drafter / "draft_vocab.json").write_text(content)
    with pytest.raises(ValueError, match=error):
        loading.load_drafter(drafter)


def test_a_vocabulary_beyond_the_targets_is_a_model_mismatch(tiny_pair, tmp_path):
    drafter = with_vocab(tiny_pair[1], tmp_path / "drafter", [1, 2, 600])
    config = json.loads((drafter / "config.json").read_text())
    config.pop("vocab_size", None)  # nothing to check it against at load: the engine must
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelMismatchError, match="600"):
        load_engine(str(tiny_pair[0]), str(drafter))


def test_the_vocabulary_is_the_most_written_tokens_with_eos():
    answers = [
        [5, 5, 5, 9, 9, 3],
        [9, 5, 1],
        [7, 7, 7, 7, 2],
    ]  # 5: 4, 7: 4, 9: 3, then 1, 2, 3 once
    vocab = export.draft_vocab(answers, vocab_size=16, size=3, always=[15])
    assert vocab["token_ids"] == [
        5,
        7,
        15,
    ]  # 15 forced in, then the two most written (ties: lower id)
    assert vocab["answers"] == 3 and vocab["answer_tokens"] == 14
    assert vocab["coverage"] == pytest.approx(8 / 14, abs=1e-5)
    assert export.draft_vocab(answers, 16, 4)["token_ids"] == [1, 5, 7, 9]

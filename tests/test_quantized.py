"""Quantized targets: tiny seeded qwen3, qwen3_5 (hybrid) and qwen3_5_moe (hybrid MoE) models,
quantized by mlx-lm's own converter in every mode MLX 0.32 loads (affine 4 and 8 bits in groups
of 32, 64 and 128; mxfp4, mxfp8, nvfp4), saved in mlx-lm's format and loaded by the engine's
loader. Greedy DFlash equals mlx-lm's own greedy decoding of the same quantized model
(``stream_generate``) token for token, at batch 1 and batched with ragged acceptance, with EOS
and budget cuts inside a block; the few-row matmul routing leaves quantized layers to MLX; the
warm-up times every width on a quantized target and the scheduler chooses from those costs.

Activations are fp32: the source models are fp32, so affine scales are too; the mx/nv modes'
scales are 8-bit floats whose dequantized values (a few significant bits times a scale) are
exact in any float type.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load as mlx_load
from mlx_lm import stream_generate

from dflash_batch.engine import load_engine
from tests import synthetic
from tests.helpers import PROMPTS_B, fixed_costs
from tests.scripting import ScriptedDrafts

FAMILIES = {
    "qwen3": lambda: synthetic.tiny_qwen3_config(),
    # hidden 128: every layer's input width divides a group of 128, so every layer is quantized
    "qwen3_5": lambda: synthetic.tiny_qwen3_5_config(hidden=128),
    "qwen3_5_moe": lambda: synthetic.tiny_qwen3_5_config(hidden=128, moe=True),
}
# (mode, group size, bits): mlx-lm's affine recipes and the other modes mx.quantize has
QUANTS = {
    "affine4-g32": ("affine", 32, 4),
    "affine4-g64": ("affine", 64, 4),
    "affine4-g128": ("affine", 128, 4),
    "affine8-g32": ("affine", 32, 8),
    "affine8-g64": ("affine", 64, 8),
    "affine8-g128": ("affine", 128, 8),
    "mxfp4": ("mxfp4", 32, 4),
    "mxfp8": ("mxfp8", 32, 8),
    "nvfp4": ("nvfp4", 16, 4),
}
BLOCK = 8
PROMPTS = PROMPTS_B[:4]  # 2 to about 100 tokens, one of them chat messages
BUDGETS = [13, 30, 21, 37]  # 13 = the prefill's token, a block of 8, then 4 of the next
P_WRONG = [0.0, 0.15, 0.4, 0.8]  # whole blocks in one row, short ones in another


@pytest.fixture(scope="session")
def quantized(tmp_path_factory):
    """(family, quant) -> (quantized target folder, drafter folder); built once per session."""
    root = tmp_path_factory.mktemp("quantized")
    built = {}

    def get(family: str, quant: str):
        if (family, quant) not in built:
            config = FAMILIES[family]()
            source = root / family
            if not source.exists():
                synthetic.save_target(source, config, seed=3)
                synthetic.save_drafter(root / f"{family}-draft", synthetic.drafter_config(config, block_size=BLOCK), seed=5)
            mode, group, bits = QUANTS[quant]
            target = synthetic.save_quantized(source, root / f"{family}-{quant}", mode, group, bits)
            built[family, quant] = target, root / f"{family}-draft"
        return built[family, quant]

    return get


def reference(folder: Path, ids, max_tokens: int, eos) -> list:
    """mlx-lm's own greedy decoding (``stream_generate``, argmax) of the model in ``folder``,
    cut before the first of ``eos``."""
    model, tokenizer = _loaded(folder)
    out = []
    for r in stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens):
        if r.token in eos:
            break
        out.append(int(r.token))
    return out


_MODELS: dict = {}


def _loaded(folder: Path):
    if folder not in _MODELS:
        _MODELS[folder] = mlx_load(str(folder))
    return _MODELS[folder]


def unquantized_layers(model: nn.Module) -> list:
    """Paths of the layers mlx-lm could have quantized and did not."""
    return [path for path, m in model.named_modules() if hasattr(m, "to_quantized")]


def modes_used(model: nn.Module) -> set:
    return {(m.mode, m.group_size, m.bits) for _, m in model.named_modules() if hasattr(m, "bits")}


def scripted_engine(target, draft, monkeypatch, **kw):
    """An engine over the quantized target with given pass costs, the prompts' ids, the target's
    own greedy outputs, and drafts scripted from them (row n wrong with probability P_WRONG[n])."""
    engine = load_engine(str(target), str(draft), prefill_chunk=256, cost_model=fixed_costs(), **kw)
    script = ScriptedDrafts(monkeypatch)
    ids = [engine.encode(p) for p in PROMPTS]
    eos = engine.tokenizer.eos_token_ids
    refs = [reference(target, i, n, eos) for i, n in zip(ids, BUDGETS)]
    return engine, script, ids, refs


def eos_inside_a_block(refs):
    """(row, k): token k of that row, not seen in it before, ends no block. The prefill commits
    token 0 and cycle c tokens 8c - 7 .. 8c, so k ends a block when k % 8 == 0; k > 8 so that
    a cycle has committed a whole block first."""
    for row in sorted(range(len(refs)), key=lambda r: -len(refs[r])):
        ref = refs[row]
        for k in range(BLOCK + 1, len(ref)):
            if k % BLOCK and ref[k] not in ref[:k]:
                return row, k
    raise AssertionError("no output has a new token inside a block: choose other prompts")


def rescript(script, ids, refs, p_wrong=P_WRONG):
    script.references.clear()  # the same seeds: each run draws the same corruptions
    for n, (i, ref) in enumerate(zip(ids, refs)):
        script(i + ref + [0] * 2 * BLOCK, p_wrong=p_wrong[n], seed=n)


# -- the models load quantized, as mlx-lm saved them -----------------------------------------------


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_loads_the_target_quantized_as_mlx_lm_saved_it(quantized, family, quant):
    target, draft = quantized(family, quant)
    config = json.loads((target / "config.json").read_text())
    mode, group, bits = QUANTS[quant]
    assert (config["quantization"]["mode"], config["quantization"]["group_size"], config["quantization"]["bits"]) == (mode, group, bits)
    engine = load_engine(str(target), str(draft))
    model = engine.target.model
    assert unquantized_layers(model) == []
    used = modes_used(model)
    assert (mode, group, bits) in used
    # qwen3_5_moe's routers stay affine 8-bit, as mlx-lm's own predicate wants
    assert used - {(mode, group, bits)} == ({("affine", 64, 8)} if family == "qwen3_5_moe" else set())
    assert isinstance(engine.target.embed_tokens, nn.QuantizedEmbedding)
    assert engine.target.hidden_size == config["hidden_size"]


# -- greedy DFlash equals the quantized target's own greedy --------------------------------------


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_dflash_equals_the_quantized_targets_own_greedy(quantized, monkeypatch, family, quant):
    """Each prompt alone, then all four in one batch whose rows accept differently (whole blocks
    in one, short runs in another): every row equals mlx-lm's greedy decoding of the quantized
    model; drafts were verified and some accepted, at several acceptance lengths."""
    engine, script, ids, refs = scripted_engine(*quantized(family, quant), monkeypatch, adaptive_block=False)
    rescript(script, ids, refs)
    alone = [engine.generate(i, max_tokens=n) for i, n in zip(ids, BUDGETS)]
    assert [c.token_ids for c in alone] == refs
    rescript(script, ids, refs)
    batched = engine.generate_batch(ids, max_tokens=BUDGETS, batch_size=len(ids))
    for n, (c, ref) in enumerate(zip(batched, refs)):
        assert c.token_ids == ref, f"row {n}"
        assert c.stats.drafted_tokens > 0, f"row {n}"
    assert batched[0].stats.accepted_tokens > 0 and batched[3].stats.drafted_tokens > batched[3].stats.accepted_tokens
    lengths = {k for c in batched for k, count in enumerate(c.stats.acceptance_histogram) if count}
    assert len(lengths) >= 3, lengths  # ragged: rows committed different lengths in the same cycles


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_eos_and_budgets_cut_inside_a_block(quantized, monkeypatch, chain_drafts, family, quant):
    """Every draft right, so each cycle commits a whole block of 8: an EOS inside a block of
    one row, and budgets of 13, 21 and 37 tokens, end rows mid-block, alone and batched."""
    target, draft = quantized(family, quant)
    engine, script, ids, refs = scripted_engine(target, draft, monkeypatch, adaptive_block=False)
    row, k = eos_inside_a_block(refs)
    eos = refs[row][k]
    engine.tokenizer.eos_token_ids = {eos}
    want = [ref[: ref.index(eos)] if eos in ref else ref for ref in refs]
    rescript(script, ids, refs, p_wrong=[0.0] * len(ids))
    alone = [engine.generate(i, max_tokens=n) for i, n in zip(ids, BUDGETS)]
    rescript(script, ids, refs, p_wrong=[0.0] * len(ids))
    batched = engine.generate_batch(ids, max_tokens=BUDGETS, batch_size=3)
    for run in (alone, batched):
        assert [c.token_ids for c in run] == want
        assert run[row].stop_reason == "eos" and len(run[row].token_ids) == k
        assert all(c.stats.drafted_tokens > 0 and c.stats.accepted_tokens > 0 for c in run)
    for c, ref, n in zip(batched, want, BUDGETS):
        if len(ref) == n:  # stopped by its budget
            assert c.finish_reason == "length"

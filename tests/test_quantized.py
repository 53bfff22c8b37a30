"""Quantized targets: tiny seeded qwen3, qwen3_5 (hybrid) and qwen3_5_moe (hybrid MoE) models,
quantized by mlx-lm's own converter in every mode MLX 0.32 loads (affine 4 and 8 bits in groups
of 32, 64 and 128, and mlx-lm's mixed 3/6-bit recipe; mxfp4, mxfp8, nvfp4; nvfp4 with a global
scale on MoE experts, whose decoding MLX runs on a GPU only), saved in mlx-lm's format and loaded
by the engine's loader. Greedy DFlash equals mlx-lm's own greedy decoding of the same quantized model
(``stream_generate``) token for token, at batch 1 and batched with ragged acceptance, with EOS
and budget cuts inside a block; the few-row matmul routing leaves quantized layers to MLX; the
warm-up times every width on a quantized target and the width policy chooses from those costs.

Activations are fp32: the source models are fp32, so affine scales are too; the mx/nv modes'
scales are 8-bit floats whose dequantized values (a few significant bits times a scale) are
exact in any float type.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dflash_batch.engine import load_engine, warmup
from dflash_batch.engine.ops import matmul, switch
from dflash_batch.engine.ops.kernels import matmul as km
from dflash_batch.engine.widths import CostModel

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load as mlx_load
from mlx_lm import stream_generate

from tests import synthetic
from tests.helpers import PROMPTS_B, fixed_costs
from tests.scripting import ScriptedDrafts

FAMILIES = {
    "qwen3": lambda: synthetic.tiny_qwen3_config(),
    # hidden 128: every layer's input width divides a group of 128, so every layer is quantized
    "qwen3_5": lambda: synthetic.tiny_qwen3_5_config(hidden=128),
    "qwen3_5_moe": lambda: synthetic.tiny_qwen3_5_config(hidden=128, moe=True),
}
CONFIGS = dict(
    FAMILIES, qwen3_untied=lambda: dict(synthetic.tiny_qwen3_config(), tie_word_embeddings=False)
)
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
    # mlx-lm's mixed recipe: 3 bits, 6 for some layers (v_proj, down_proj of chosen layers)
    "mixed_3_6": ("affine", 64, None, "mixed_3_6"),
}
# nvfp4 with one tensor scale per expert on the switch layers (mlx-lm's global_scale): MoE only
MOE_ONLY = {"nvfp4-global": ("nvfp4", 16, 4, None, True)}
CASES = [pytest.param(f, q, id=f"{f}-{q}") for f in FAMILIES for q in QUANTS]
LOADED = CASES + [pytest.param("qwen3_5_moe", q, id=f"qwen3_5_moe-{q}") for q in MOE_ONLY]
GPU_ONLY = pytest.mark.skipif(
    mx.default_device() == mx.cpu, reason="MLX 0.32.4 runs gather_qmm's global scale on a GPU only"
)
DECODED = CASES + [
    pytest.param("qwen3_5_moe", q, id=f"qwen3_5_moe-{q}", marks=GPU_ONLY) for q in MOE_ONLY
]
BLOCK = 8
PROMPTS = PROMPTS_B[:4]  # 2 to about 100 tokens, one of them chat messages
BUDGETS = [13, 30, 21, 37]  # 13 = the prefill's token, a block of 8, then 4 of the next
P_WRONG = [0.0, 0.15, 0.4, 0.8]  # whole blocks in one row, short ones in another
VOCAB = list(range(0, 512, 3)) + [7, 11]  # a draft vocabulary: 173 of the 512 tokens


@pytest.fixture(scope="session")
def quantized(tmp_path_factory):
    """(family, quant) -> (quantized target folder, drafter folder), built once per session;
    quant None: the unquantized source."""
    root = tmp_path_factory.mktemp("quantized")
    built = {}

    def get(family: str, quant: str):
        if (family, quant) not in built:
            config = CONFIGS[family]()
            source = root / family
            if not source.exists():
                synthetic.save_target(source, config, seed=3)
                synthetic.save_drafter(
                    root / f"{family}-draft",
                    synthetic.drafter_config(config, block_size=BLOCK),
                    seed=5,
                )
            target = source
            if quant is not None:
                target = synthetic.save_quantized(
                    source, root / f"{family}-{quant}", *{**QUANTS, **MOE_ONLY}[quant]
                )
            built[family, quant] = target, root / f"{family}-draft"
        return built[family, quant]

    return get


def reference(folder: Path, ids, max_tokens: int, eos=()) -> list:
    """mlx-lm's own greedy decoding (``stream_generate``, argmax) of the model in ``folder``,
    stopping at the first of ``eos`` (none: the whole budget); kept, as several tests ask for
    the same."""
    key = (folder, tuple(ids), max_tokens, frozenset(eos))
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(folder, ids, max_tokens, eos)
    return list(_REFERENCES[key])


_REFERENCES: dict = {}


def _reference(folder: Path, ids, max_tokens: int, eos) -> list:
    model, tokenizer = _loaded(folder)
    own, tokenizer.eos_token_ids = (
        tokenizer.eos_token_ids,
        set(eos),
    )  # stream_generate stops at these
    try:
        out = [
            int(r.token)
            for r in stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens)
        ]
    finally:
        tokenizer.eos_token_ids = own
    return out[:-1] if out and out[-1] in eos else out


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
    """An engine over the quantized target with given pass costs and no EOS (every row runs to
    its budget, whatever a random model writes), the prompts' ids, the target's own greedy
    outputs, and the drafts scripted from them (``rescript``)."""
    engine = load_engine(str(target), str(draft), prefill_chunk=256, cost_model=fixed_costs(), **kw)
    engine.tokenizer.eos_token_ids = set()
    script = ScriptedDrafts(monkeypatch)
    ids = [engine.encode(p) for p in PROMPTS]
    refs = [reference(target, i, n) for i, n in zip(ids, BUDGETS)]
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


def expected_modes(family: str, quant: str) -> set:
    """(mode, group size, bits) of the layers mlx-lm's quantizer makes for this case."""
    mode, group, bits, *recipe = {**QUANTS, **MOE_ONLY}[quant]
    if recipe and recipe[0] == "mixed_3_6":
        return {(mode, group, 3), (mode, group, 6)}  # the recipe decides every layer, routers too
    routers = (
        {("affine", 64, 8)} if family == "qwen3_5_moe" else set()
    )  # mlx-lm's predicate keeps them 8-bit
    return {(mode, group, bits)} | routers


@pytest.mark.parametrize("family,quant", LOADED)
def test_the_engine_loads_the_target_quantized_as_mlx_lm_saved_it(quantized, family, quant):
    target, draft = quantized(family, quant)
    config = json.loads((target / "config.json").read_text())
    mode, group = {**QUANTS, **MOE_ONLY}[quant][:2]
    assert (config["quantization"]["mode"], config["quantization"]["group_size"]) == (mode, group)
    engine = load_engine(str(target), str(draft))
    model = engine.target.model
    assert unquantized_layers(model) == []
    assert modes_used(model) == expected_modes(family, quant)
    if quant in MOE_ONLY:
        scaled = [path for path, m in model.named_modules() if "global_scale" in m]
        assert scaled and all(".switch_mlp." in path for path in scaled)
    assert isinstance(engine.target.embed_tokens, nn.QuantizedEmbedding)
    assert engine.target.hidden_size == config["hidden_size"]


# -- greedy DFlash equals the quantized target's own greedy --------------------------------------


@pytest.mark.parametrize("family,quant", DECODED)
def test_greedy_dflash_equals_the_quantized_targets_own_greedy(
    quantized, monkeypatch, family, quant
):
    """Each prompt alone, then all four in one batch whose rows accept differently (whole blocks
    in one, short runs in another): every row equals mlx-lm's greedy decoding of the quantized
    model; drafts were verified and some accepted, at several acceptance lengths."""
    engine, script, ids, refs = scripted_engine(
        *quantized(family, quant), monkeypatch, adaptive_block=False
    )
    rescript(script, ids, refs)
    alone = [engine.generate(i, max_tokens=n) for i, n in zip(ids, BUDGETS)]
    assert [c.token_ids for c in alone] == refs
    rescript(script, ids, refs)
    batched = engine.generate_batch(ids, max_tokens=BUDGETS, batch_size=len(ids))
    for n, (c, ref) in enumerate(zip(batched, refs)):
        assert c.token_ids == ref, f"row {n}"
        assert c.stats.drafted_tokens > 0, f"row {n}"
    assert (
        batched[0].stats.accepted_tokens > 0
        and batched[3].stats.drafted_tokens > batched[3].stats.accepted_tokens
    )
    lengths = {k for c in batched for k, count in enumerate(c.stats.acceptance_histogram) if count}
    assert len(lengths) >= 3, lengths  # ragged: rows committed different lengths in the same cycles


@pytest.mark.parametrize("family,quant", DECODED)
def test_eos_and_budgets_cut_inside_a_block(quantized, monkeypatch, chain_drafts, family, quant):
    """Every draft right, so each cycle commits a whole block of 8: an EOS inside a block of
    one row, and budgets of 13, 21 and 37 tokens, end rows mid-block, alone and batched."""
    target, draft = quantized(family, quant)
    engine, script, ids, refs = scripted_engine(target, draft, monkeypatch, adaptive_block=False)
    row, k = eos_inside_a_block(refs)
    eos = refs[row][k]
    engine.tokenizer.eos_token_ids = {eos}
    want = [reference(target, i, n, {eos}) for i, n in zip(ids, BUDGETS)]  # mlx-lm stopping at it
    assert len(want[row]) == k
    rescript(script, ids, refs, p_wrong=[0.0] * len(ids))
    alone = [engine.generate(i, max_tokens=n) for i, n in zip(ids, BUDGETS)]
    rescript(script, ids, refs, p_wrong=[0.0] * len(ids))
    batched = engine.generate_batch(ids, max_tokens=BUDGETS, batch_size=3)
    for run in (alone, batched):
        assert [c.token_ids for c in run] == want
        assert run[row].stop_reason == "eos" and len(run[row].token_ids) == k
        assert all(c.stats.accepted_tokens > 0 for c in run if len(c.token_ids) > BLOCK)
    for c, ref, n in zip(batched, want, BUDGETS):
        if len(ref) == n:  # stopped by its budget
            assert c.finish_reason == "length"


# -- the cut head a draft vocabulary uses --------------------------------------------------------


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize(
    "family", ["qwen3", "qwen3_untied"]
)  # a tied embedding, a separate lm_head
def test_cut_head_equals_the_quantized_heads_columns(quantized, family, quant):
    """``Target.head_rows`` copies the head's rows quantized (scales, and biases where the mode
    has them): its logits are the whole head's at those rows, bit for bit."""
    engine = load_engine(str(quantized(family, quant)[0]), None)
    target = engine.target
    head = target.embed_tokens if family == "qwen3" else target.model.lm_head
    assert (
        isinstance(head, (nn.QuantizedEmbedding, nn.QuantizedLinear))
        and head.mode == QUANTS[quant][0]
    )
    ids = mx.array(VOCAB, dtype=mx.int32)
    h = mx.random.normal((2, 5, target.hidden_size), key=mx.random.key(3))
    assert mx.array_equal(target.head_rows(ids)(h), target.lm_head(h)[..., ids]).item()


@pytest.mark.parametrize("quant", ["affine4-g64", "mxfp4", "nvfp4"])
def test_a_draft_vocabulary_over_a_quantized_head_drafts_from_it_and_is_lossless(
    quantized, tmp_path, quant
):
    """The real (random) drafter, its drafts picked from a vocabulary through the quantized head's
    cut rows: every draft lies in the vocabulary and the output is the target's own greedy."""
    target, draft = quantized("qwen3", quant)
    vocab_draft = tmp_path / "draft"
    shutil.copytree(draft, vocab_draft)
    (vocab_draft / "draft_vocab.json").write_text(json.dumps({"token_ids": VOCAB}))
    engine = load_engine(
        str(target), str(vocab_draft), cost_model=fixed_costs(), adaptive_block=False
    )
    assert engine.draft_head is not None
    engine.tokenizer.eos_token_ids = set()  # every row runs to its budget
    ids = [engine.encode(p) for p in PROMPTS]
    refs = [reference(target, i, n) for i, n in zip(ids, BUDGETS)]
    batched = engine.generate_batch(ids, max_tokens=BUDGETS, batch_size=len(ids))
    assert [c.token_ids for c in batched] == refs
    assert all(c.stats.drafted_tokens > 0 for c in batched)


# -- the few-row matmul routing leaves quantized layers to MLX -----------------------------------


def fake_kernel(monkeypatch):
    """Routing forced on as on CUDA, the kernel replaced by MLX's product plus a record of the
    weights it was given (the CPU has no CUDA)."""
    calls = []

    def kernel(x, w):
        calls.append(w)
        return km.matmul_reference(x, w)

    monkeypatch.setattr(km, "matmul_kernel", kernel)
    monkeypatch.setattr(km, "kernel_verified", lambda dtype, backend="cuda": True)
    monkeypatch.setattr(matmul.device, "backend", lambda: "cuda")
    return calls


def routed_logits(engine, ids):
    """``verify_logits`` with the few-row products routed to the kernel, as on CUDA."""
    return verify_logits(engine, ids, "kernel")


def verify_logits(engine, ids, matmul_mode="stock"):
    target = engine.target
    cache = target.make_cache()
    with switch.modes(matmul=matmul_mode):
        logits, _ = target.verify(mx.array([ids]), cache)
        mx.eval(logits)
    return logits


@pytest.mark.parametrize("family", FAMILIES)
def test_few_row_routing_leaves_quantized_layers_to_mlx(quantized, monkeypatch, family):
    """Fully quantized: no layer is re-classed and no product reaches the kernel. Partly
    quantized (mlx-lm's converter told to leave the MLPs alone): only the plain layers' products
    do, and the logits are those of routing off."""
    engine = load_engine(str(quantized(family, "affine4-g64")[0]), None)
    assert not [
        m for _, m in engine.target.model.named_modules() if isinstance(m, matmul.RoutedLinear)
    ]
    ids = list(range(5, 13))
    stock = verify_logits(engine, ids)
    calls = fake_kernel(monkeypatch)
    assert mx.array_equal(routed_logits(engine, ids), stock).item() and calls == []

    source = quantized(family, None)[0]
    partly = synthetic.save_quantized(
        source,
        source.parent / f"{family}-attention-only",
        "affine",
        64,
        4,
        quant_predicate=lambda path, module: ".mlp" not in path,
    )
    engine = load_engine(str(partly), None)
    routed = [
        m for _, m in engine.target.model.named_modules() if isinstance(m, matmul.RoutedLinear)
    ]
    assert routed and engine.target.quantized
    stock = verify_logits(engine, ids)
    calls = fake_kernel(monkeypatch)
    assert mx.array_equal(routed_logits(engine, ids), stock).item()
    assert calls and all(
        w.dtype == mx.float32 for w in calls
    )  # plain weights only, never packed ones
    assert {id(w) for w in calls} <= {id(m.weight) for m in routed}


# -- the cost model learns what widths cost on a quantized target --------------------------------

# A quantized verify pass whose product switches to the slower path above 3 rows, with costs at
# 1, 4 and 8 rows on a line: the line alone would price 2 and 3 rows at 1.17 and 1.33.
STEP = {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.5, 6: 1.75, 8: 2.0}


def test_the_warm_up_times_every_width_on_a_quantized_target(quantized, monkeypatch):
    """On a GPU the warm-up times three widths, and every width only where the middle one is off
    the line; on a quantized target always, so a qmv -> qmm step between timed widths is seen.
    The same costs on the unquantized model time three (the control)."""
    monkeypatch.setattr(warmup, "_quick", lambda: False)
    asked = []

    class Timed:
        def __init__(self, engine, B, n):
            self.B = B

        def target(self, T):
            asked.append((self.B, T))
            return STEP[T] * self.B

        def draft(self):
            return 0.5

    monkeypatch.setattr(warmup, "_Passes", Timed)
    for quant, timed in (("affine4-g64", sorted(STEP)), (None, [1, 4, 8])):
        engine = load_engine(*map(str, quantized("qwen3_5", quant)))
        asked.clear()
        cost = warmup.measure_costs(engine, 4, 128)
        assert engine.target.quantized == (quant is not None)
        assert sorted(cost.timed) == timed, quant
        assert sorted(T for B, T in asked if B == 4) == timed
        if quant is not None:
            assert cost.target(4, 2) == pytest.approx(STEP[2] * 4)


# Dearer still: a verify pass of 4 rows or more costs three times one of 3.
DEAR = {1: 1.0, 2: 1.02, 3: 1.04, 4: 3.0, 6: 3.5, 8: 4.0}


def test_the_warm_up_times_passes_of_the_quantized_model_itself(quantized, monkeypatch):
    """The timed verify passes are the quantized target's own (its quantized products run in
    each) on a hybrid MoE target, at every width the cost model says it timed; nothing here reads
    a time but to check that one was taken."""
    engine = load_engine(*map(str, quantized("qwen3_5_moe", "affine4-g64")))
    target, products, passes = engine.target, [], []
    real_product, real_pass = nn.QuantizedLinear.__call__, target.decode_pass

    def product(self, x):
        products.append(x.size // x.shape[-1])
        return real_product(self, x)

    def verify(tokens, cache):
        products.clear()
        out = real_pass(tokens, cache)
        passes.append((tokens.shape, set(products)))
        return out

    monkeypatch.setattr(nn.QuantizedLinear, "__call__", product)
    monkeypatch.setattr(target, "decode_pass", verify)
    cost = engine.warm_up(2, context=40)
    assert cost.passes(2, 4) > 0 and cost.timed
    for T in cost.timed:  # a pass of 2 rows x T tokens, through the quantized layers
        assert any(shape == (2, T) and 2 * T in rows for shape, rows in passes), T


@pytest.mark.parametrize("costs,widest", [(DEAR, 3), ({T: 1.0 for T in STEP}, BLOCK)])
def test_the_width_policy_verifies_below_the_step_its_costs_show(
    quantized, monkeypatch, chain_drafts, costs, widest
):
    """Given a cost model that prices the widths as measured on a quantized target (wide
    verify passes dear above 3 rows), a drafter right every time is verified at 3 rows or fewer;
    given flat costs, at the whole block (the control). Output stays the target's own greedy."""
    target, draft = quantized("qwen3_5", "affine4-g64")
    cost = CostModel(t0=1.0, d0=0.1, window=0, rows=1, timed=dict(costs))
    engine = load_engine(str(target), str(draft), cost_model=cost)
    engine.tokenizer.eos_token_ids = set()  # the whole budget
    script = ScriptedDrafts(monkeypatch)
    ids = engine.encode(PROMPTS[1])
    ref = reference(target, ids, 40)
    script(ids + ref + [0] * 2 * BLOCK, p_wrong=0.0)
    assert engine.generate_batch([ids], max_tokens=40, batch_size=1)[0].token_ids == ref
    drafting = [T for T in engine.decode_counts if T > 1]
    assert drafting and max(drafting) == widest


# -- the GPU benchmark's smoke run --------------------------------------------------------------


def test_the_quantized_benchmark_smoke_run_is_well_formed(tmp_path):
    """``benchmarks/quantized.py --smoke``: every arm at both batch sizes, the verify widths of
    each engine arm, the scripted arm's target choosing token 0 as its script assumes, and the
    divergence count over its rows; JSON and the markdown table written."""
    from benchmarks import quantized as bench

    out = bench.main(["--smoke", "--out", str(tmp_path / "q.json")])
    doc = json.loads(out.read_text())
    assert doc["quantization"] == {"mode": "affine", "group_size": 64, "bits": 4}
    arms = {(r["arm"], r["batch"]): r for r in doc["results"]}
    assert {arm for arm, _ in arms} == {
        "mlx_lm.batch_generate",
        "dflash plain",
        "dflash tau=6.5",
        "dflash random",
    }
    assert {b for _, b in arms} == {1, 2} and all(r["status"] == "ok" for r in arms.values())
    for (arm, _), r in arms.items():
        assert r["figures"]["tokens"] == 4 * 8
        if arm.startswith("dflash"):
            assert sum(c["cycles"] for c in r["figures"]["cycles"].values()) > 0
    assert all(arms["dflash tau=6.5", b]["figures"]["all_token_0"] for b in (1, 2))
    pairs = doc["divergence"]["pairs"]
    assert len(pairs) == 3 and all(p["rows"] == 3 for p in pairs)
    table = out.with_suffix(".md").read_text()
    assert "| dflash tau=6.5 |" in table and "Verify widths chosen" in table and "of 3" in table


@pytest.mark.parametrize(
    "name,drafter",
    [
        ("mlx-community/Qwen3.5-27B-4bit", "z-lab/Qwen3.5-27B-DFlash"),
        ("mlx-community/Qwen3.5-35B-A3B-4bit", "z-lab/Qwen3.5-35B-A3B-DFlash"),
        ("mlx-community/Qwen3-8B-8bit", "z-lab/Qwen3-8B-DFlash-b16"),
        ("mlx-community/Qwen3.5-9B-MLX-mxfp4", "z-lab/Qwen3.5-9B-DFlash"),
    ],
)
def test_auto_finds_the_drafter_of_a_quantized_repo_name(name, drafter):
    """``draft="auto"`` pairs repo names in mlx-community's form (the base name, then the
    quantization) with their base model's drafter; names only: nothing is fetched."""
    from dflash_batch.engine.models import registry

    assert registry.registered_drafter(name)[0] == drafter

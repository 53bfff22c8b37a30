"""Target families beside qwen3 / qwen3_5 (tests/families.py): greedy DFlash equals mlx-lm's own
greedy decoding of the same model, token for token (fp32, CPU), alone and in ragged batches,
through mixture-of-experts layers, sliding-window layers (prompts far longer than the window),
attention sinks and KV-shared layers; EOS and budget cuts inside a block."""

from __future__ import annotations

from dflash_batch.engine import load_engine
from dflash_batch.engine.models.target import Target
from dflash_batch.engine.ops import attention, device, switch
from dflash_batch.engine.ops.batch_cache import Lengths, RaggedKVCache

import mlx.core as mx
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from tests import families, synthetic
from tests.helpers import P_WRONG, PROMPTS_B, greedy_reference, scripted_batch
from tests.scripting import ScriptedDrafts

FAMILIES = [
    "qwen3_moe",
    "llama",
    "gemma4_text",
    "gemma4",
    "gpt_oss",
    "laguna",
]  # gemma4_ple: one test
WINDOWED = ["llama", "gemma4_text", "gemma4", "gpt_oss", "laguna"]
PROMPTS = PROMPTS_B[:5]  # chat-templated: about 20 to 60 tokens, far longer than the window
BUDGETS = [7, 40, 23, 33, 17]  # none a whole number of blocks: cuts fall inside them


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    built = {}

    def get(family):
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            cfg = families.CONFIGS[family]()
            seed, adjust = families.SEEDS.get(family, 3), families.ADJUST.get(family)
            target = synthetic.save_target(root / "target", cfg, seed=seed, adjust=adjust)
            draft_cfg = synthetic.drafter_config(families.text_config(cfg), block_size=8)
            draft = synthetic.save_drafter(root / "draft", draft_cfg, seed=4)
            built[family] = (target, draft)
        return built[family]

    return get


def _windowed_calls(monkeypatch):
    """Record (window, with sinks) of every routed attention call."""
    seen = []
    block_attention = attention._block_attention

    def counted(impl, q, k, v, scale, causal, window, kv_len=None, sinks=None):
        seen.append((window, sinks is not None))
        return block_attention(impl, q, k, v, scale, causal, window, kv_len, sinks)

    monkeypatch.setattr(attention, "_block_attention", counted)
    return seen


ON_GPU = pytest.mark.skipif(
    device.gpu() is None, reason="the block attention kernels need CUDA or Metal"
)


@pytest.mark.parametrize("mode", ["stock", "reference", pytest.param("kernel", marks=ON_GPU)])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_dflash_equals_mlx_lm_alone_and_batched(pair, monkeypatch, family, mode):
    """Scripted drafts wrong at rates 0 to 1 (ragged acceptance in every batch); "reference" routes
    the verify attention (per-row key lengths, the sliding window) as the GPU kernels run it, and
    "kernel" runs the kernels themselves (sinks: stock SDPA)."""
    target, draft = pair(family)
    engine, script, ids, refs = scripted_batch(
        target,
        draft,
        monkeypatch,
        PROMPTS,
        BUDGETS,
        adaptive_block=False,
        attention=mode,
        drafts="chain",
    )
    assert max(map(len, ids)) > 5 * families.WINDOW
    windows = _windowed_calls(monkeypatch)
    batched = engine.generate_batch(ids, max_tokens=BUDGETS, batch_size=3)
    assert [c.token_ids for c in batched] == refs
    script.references.clear()  # the same corruptions alone as in the batch
    for n, (i, ref) in enumerate(zip(ids, refs)):
        script(i + ref + [0] * 16, p_wrong=P_WRONG[n], seed=n)
    alone = [engine.generate(i, max_tokens=m) for i, m in zip(ids, BUDGETS)]
    assert [c.token_ids for c in alone] == refs
    hist = [sum(h) for h in zip(*(c.stats.acceptance_histogram for c in batched))]
    assert hist[1] and sum(map(bool, hist[2:])) >= 4, (
        hist
    )  # drafts rejected, and accepted at many lengths
    if (
        mode == "reference" and family in WINDOWED
    ):  # sliding layers (with their sinks) went through the routed attention
        assert (families.WINDOW, family == "gpt_oss") in windows
    if mode == "kernel" and family in WINDOWED and family != "gpt_oss":
        assert (families.WINDOW, False) in windows


def test_moe_target_verifies_draft_trees(pair, monkeypatch):
    """qwen3_moe's layers attend to every earlier key, so its cycles may verify draft trees (the
    CPU's default): experts chosen per node, the accepted path moved to the front of the cache."""
    from dflash_batch.engine import tree

    target, draft = pair("qwen3_moe")
    engine, _, ids, refs = scripted_batch(
        target, draft, monkeypatch, PROMPTS, BUDGETS, adaptive_block=False, drafts="tree"
    )
    walked = []
    real_walk = tree.walk
    monkeypatch.setattr(
        tree, "walk", lambda trees, chosen: walked.append(real_walk(trees, chosen)) or walked[-1]
    )
    batched = engine.generate_batch(ids, max_tokens=BUDGETS, batch_size=3)
    assert [c.token_ids for c in batched] == refs
    assert (
        sum(any(p != list(range(len(p))) for p in paths) for paths in walked) > 3
    )  # branches taken


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_inside_a_block_per_row(pair, monkeypatch, family):
    target, draft = pair(family)
    engine = load_engine(str(target), str(draft), prefill_chunk=256, adaptive_block=False)
    script = ScriptedDrafts(monkeypatch)
    ids = [engine.encode(p) for p in PROMPTS]
    refs = [greedy_reference(target, i, 40, engine.tokenizer.eos_token_ids) for i in ids]
    for i, ref in zip(ids, refs):
        script(i + ref + [0] * 16, p_wrong=0.0)  # whole blocks accepted: the cut falls inside one
    k = next(i for i in range(9, len(refs[1])) if refs[1][i] not in refs[1][:i] and i % 8)
    engine.tokenizer.eos_token_ids = {refs[1][k]}
    batched = engine.generate_batch(ids, max_tokens=40, batch_size=3)
    alone = [engine.generate(i, max_tokens=40) for i in ids]
    assert batched[1].token_ids == refs[1][:k] and batched[1].stop_reason == "eos"
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    for c, ref in zip(batched, refs):  # every row: its greedy output up to the first EOS id
        assert c.token_ids == ref[: ref.index(refs[1][k])] if refs[1][k] in ref else ref


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])  # gemma4_text traces for minutes on a CPU
def test_compiled_passes_with_sliding_windows(pair, monkeypatch, family):
    """Compiled passes see the whole buffer, so the window lives in their mask and routed call."""
    target, draft = pair(family)
    engine, _, ids, refs = scripted_batch(
        target,
        draft,
        monkeypatch,
        PROMPTS,
        BUDGETS,
        adaptive_block=False,
        passes="compiled",
        attention="reference",
    )
    batched = engine.generate_batch(ids, max_tokens=BUDGETS, batch_size=3)
    assert [c.token_ids for c in batched] == refs
    assert engine.target.passes.calls["compiled"] > 0


def _ring_attention(q, keys, window, sinks=None):
    """mlx-lm's own decoding of one row: its earlier keys (= values) into a RotatingKVCache, then
    the pass's queries q [1, H, T, D] with their keys, through its mask."""
    ring, n = RotatingKVCache(max_size=window), keys.shape[2] - q.shape[2]
    if n:
        ring.update_and_fetch(keys[:, :, :n], keys[:, :, :n])
    mask = ring.make_mask(q.shape[2], window_size=window)
    k, v = ring.update_and_fetch(keys[:, :, n:], keys[:, :, n:])
    return scaled_dot_product_attention(q, k, v, ring, scale=0.25, mask=mask, sinks=sinks)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("route", ["stock", "reference"])
def test_window_attends_as_mlx_lm_ring_buffer_per_row(route, sinks):
    """A windowed ragged cache attends as mlx-lm's RotatingKVCache does, pass after pass (a long
    prefill, verify blocks, single steps), for two rows that keep different parts of each pass
    (per-row rollback) and so grow to their own lengths."""
    w, passes = 6, [4, 9, 5, 1, 4, 1, 7]  # the first inside the window, the second past it
    keep = [[4, 9, 2, 1, 4, 1, 3], [4, 9, 5, 1, 1, 1, 7]]
    mx.random.seed(0)
    q_all, k_all = mx.random.normal((2, 2, 4, 64, 16)) * 0.7  # per row: queries, keys (= values)
    sink = mx.random.normal((4,)) * 2.0 if sinks else None
    lengths = Lengths([0, 0])
    ours = RaggedKVCache(lengths, window=w)
    with switch.modes(attention=route):
        before = attention.counters()["routed"]
        for t, T in enumerate(passes):
            at = lengths.host
            q = mx.stack([q_all[b, :, at[b] : at[b] + T] for b in range(2)])
            k = mx.stack([k_all[b, :, at[b] : at[b] + T] for b in range(2)])
            mask = ours.make_mask(T)
            got = attention.target_sdpa(
                q, *ours.update_and_fetch(k, k), ours, 0.25, mask, sinks=sink
            )
            for b in range(2):
                want = _ring_attention(q[b : b + 1], k_all[b : b + 1, :, : at[b] + T], w, sink)
                assert mx.allclose(got[b : b + 1], want, atol=1e-5).item(), (t, b)
            lengths.advance([keep[b][t] for b in range(2)])
        assert (attention.counters()["routed"] > before) == (route == "reference")
    assert lengths.host == [sum(r) for r in keep]


@pytest.mark.parametrize("family", FAMILIES)
def test_last_position_logits_are_the_models_own(pair, family):
    """A prefill pass asks for the last position's logits only (``Target(..., at=)``): the head
    alone on that position where the family's logits are the head's (HEAD_AFTER_BACKBONE), the
    whole forward where they are more (gemma4_text soft-caps them)."""
    from mlx_lm.utils import load_model

    model, config = load_model(pair(family)[0])
    target = Target(model, tap_ids=[1])
    tokens = mx.array([[5, 17, 3, 88, 41, 9, 23, 60, 2, 71, 14, 30]])
    want = model(tokens)[:, -1:]
    got, hidden = target(tokens, target.make_cache(), at=mx.array([tokens.shape[1] - 1]))
    assert mx.allclose(got, want, atol=1e-5).item()
    assert hidden.shape == (
        1,
        tokens.shape[1],
        families.text_config(config)["hidden_size"],
    )  # the tap: a hidden state, not a tuple


def test_trees_only_on_full_attention_targets(pair):
    """Draft trees need per-token RoPE positions and a tree mask, which has no window."""
    from mlx_lm.utils import load_model

    trees = {family: Target(load_model(pair(family)[0])[0]).trees for family in FAMILIES}
    assert trees == {
        "qwen3_moe": True,
        "llama": False,
        "gemma4_text": False,
        "gemma4": False,
        "gpt_oss": False,
        "laguna": False,
    }


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4"])
def test_gemma_drafter_input_is_the_scaled_embedding(pair, family):
    """Gemma scales its embeddings by sqrt(hidden) inside the forward; the drafter's block input
    is that scaled embedding, as Hugging Face's embedding module returns it."""
    from mlx_lm.utils import load_model

    model, config = load_model(pair(family)[0])
    tokens = mx.array([[5, 17, 3]])
    embed = Target(model).embed_tokens
    want = embed(tokens) * families.text_config(config)["hidden_size"] ** 0.5
    assert mx.allclose(Target(model).embed(tokens), want).item()


@pytest.mark.parametrize(
    "cache", [lambda: RotatingKVCache(max_size=8, keep=4), lambda: QuantizedKVCache()]
)
def test_other_caches_are_refused_at_load_with_the_reason(pair, monkeypatch, cache):
    """A ring buffer that keeps its first positions (a window plus attention-sink tokens) or a
    quantized cache: no per-row rollback here, so the engine refuses the target before decoding."""
    from mlx_lm.utils import load_model

    model, _ = load_model(pair("llama")[0])
    monkeypatch.setattr(
        type(model), "make_cache", lambda self: [KVCache()] + [cache() for _ in self.layers[1:]]
    )
    with pytest.raises(TypeError, match="layer 1 uses (RotatingKVCache|QuantizedKVCache)"):
        Target(model).check_cache()


@pytest.mark.parametrize("target, drafter", [
    ("google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash"),
    ("mlx-community/gemma-4-31b-it-4bit", "z-lab/gemma-4-31B-it-DFlash"),
    ("openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash"),
    ("mlx-community/gpt-oss-120b-MXFP4-Q8", "z-lab/gpt-oss-120b-DFlash"),
    ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
    ("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
    ("mlx-community/Meta-Llama-3.1-8B-Instruct-4bit", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
    ("poolside/Laguna-XS-2.1", "poolside/Laguna-XS-2.1-DFlash"),
    ("meta-llama/Llama-3.1-70B-Instruct", None),  # a drafter is for one target size
    ("openai/gpt-oss-200b", None),
])  # fmt: skip
def test_published_family_pairings_are_registered(target, drafter):
    from dflash_batch.engine.models import registry

    found = registry.registered_drafter(target)
    assert (found and found[0]) == drafter


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4_ple", "gpt_oss", "laguna"])
def test_prompts_prefilled_in_chunks_past_the_window(pair, family):
    """Prefill chunks of 16 (two windows) and rows joining a running batch: every chunk after the
    first attends across the window's edge. The real (random) drafter, no scripting."""
    target, draft = pair(family)
    engine = load_engine(str(target), str(draft), prefill_chunk=16)
    ids = [engine.encode(p) for p in PROMPTS_B[5:7] + PROMPTS[:3]]
    refs = [greedy_reference(target, i, 12, engine.tokenizer.eos_token_ids) for i in ids]
    assert max(map(len, ids)) > 8 * 16
    assert [c.token_ids for c in engine.generate_batch(ids, max_tokens=12, batch_size=2)] == refs

"""Hybrid (qwen3_5) targets: the tape recurrence, its replay, rollback of a real model's cache,
and greedy DFlash on tiny qwen3_5 targets against mlx-lm's own greedy decoding (fp32, CPU).

The kernel tests run every implementation the machine has: the reference everywhere, Metal
where Metal exists, CUDA where CUDA exists (CPU CI runs the reference only).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dflash_batch.engine import load_engine
from dflash_batch.engine.models import hybrid
from dflash_batch.engine.models.target import Target
from dflash_batch.engine.ops.batch_cache import Lengths
from dflash_batch.engine.ops.blas import loaded_blas
from dflash_batch.engine.ops.kernels import gated_delta as gd
from dflash_batch.engine.ops.kernels import selfcheck

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3_5
from mlx_lm.models.gated_delta import gated_delta_ops

from tests import synthetic
from tests.helpers import fixed_costs
from tests.helpers import gated_delta_inputs as inputs
from tests.scripting import ScriptedDrafts

ROOT = Path(__file__).resolve().parents[1]
KERNELS = [
    pytest.param("metal", marks=pytest.mark.skipif(not mx.metal.is_available(), reason="no Metal")),
    pytest.param("cuda", marks=pytest.mark.skipif(not gd.cuda_available(), reason="no CUDA")),
]


def one_at_a_time(q, k, v, g, beta, state, n, impl="reference"):
    """The state after feeding the first n steps one call each, as decoding does."""
    for t in range(n):
        _, state, _ = gd.recurrence(
            *(x[:, t : t + 1] for x in (q, k, v, g, beta)), state, record=False, impl=impl
        )
    return state


# -- the recurrence and its replay -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_reference_recurrence_is_mlx_lm_bit_for_bit(dtype):
    q, k, v, g, beta, s0 = inputs(dtype=dtype)
    y, state, tape = gd.recurrence(q, k, v, g, beta, s0, impl="reference")
    y_lm, state_lm = gated_delta_ops(q, k, v, g, beta, s0)
    assert mx.array_equal(y, y_lm).item() and y.dtype == dtype
    assert mx.array_equal(state, state_lm).item()
    assert tape.shape == v.shape and tape.dtype == mx.float32
    _, _, none = gd.recurrence(q, k, v, g, beta, s0, record=False, impl="reference")
    assert none is None


def test_tape_is_the_innovation():
    """delta_t = beta_t (v_t - (g_t S_{t-1}) k_t), written out here with matrix products."""
    q, k, v, g, beta, s0 = inputs(T=3, Hk=4)  # Hk == Hv: no head repetition
    _, _, tape = gd.recurrence(q, k, v, g, beta, s0, impl="reference")
    state = s0[0]  # [Hv, Dv, Dk]
    for t in range(3):
        decayed = state * g[0, t][:, None, None]
        delta = beta[0, t][:, None] * (v[0, t] - (decayed @ k[0, t][:, :, None])[..., 0])
        assert mx.allclose(tape[0, t], delta, rtol=1e-5, atol=1e-6).item()
        state = decayed + delta[:, :, None] * k[0, t][:, None, :]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_replay_of_every_prefix_equals_one_token_at_a_time(dtype):
    q, k, v, g, beta, s0 = inputs(dtype=dtype)
    _, _, tape = gd.recurrence(q, k, v, g, beta, s0, impl="reference")
    for n in range(17):
        replayed = gd.replay(tape[:, :n], k[:, :n], g[:, :n], s0, impl="reference")
        assert mx.array_equal(replayed, one_at_a_time(q, k, v, g, beta, s0, n)).item(), n


def test_bf16_state_is_rounded_every_step_like_decoding():
    q, k, v, g, beta, s0 = inputs()
    s0 = s0.astype(mx.bfloat16)
    _, state, tape = gd.recurrence(q, k, v, g, beta, s0, impl="reference")
    assert state.dtype == mx.bfloat16
    assert mx.array_equal(state, one_at_a_time(q, k, v, g, beta, s0, 16)).item()
    for n in (1, 7, 16):
        replayed = gd.replay(tape[:, :n], k[:, :n], g[:, :n], s0, impl="reference")
        assert mx.array_equal(replayed, one_at_a_time(q, k, v, g, beta, s0, n)).item()


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernel_matches_reference(impl, dtype):
    """Tolerances (docs/hybrid.md): state and tape within 1e-5 of max |ref|; y within 1e-5 (fp32)
    or 4e-3 (bf16: one rounding of the output); the kernel's own replay and one-token calls
    reproduce its T-token call bit for bit. The raw kernel: no self-check, which would put the
    reference in place of a kernel that fails it (tests/test_kernel_selfcheck.py checks that)."""
    with selfcheck.unchecked():
        kernel_matches_reference(impl, dtype)


def kernel_matches_reference(impl, dtype):
    q, k, v, g, beta, s0 = inputs(Hk=2, Hv=4, Dk=128, Dv=64, dtype=dtype)
    y_r, s_r, tape_r = gd.recurrence(q, k, v, g, beta, s0, impl="reference")
    y, s, tape = gd.recurrence(q, k, v, g, beta, s0, impl=impl)

    def close(a, b, tol):
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        return (mx.abs(a - b).max() <= tol * mx.abs(b).max()).item()

    assert close(s, s_r, 1e-5) and close(tape, tape_r, 1e-5)
    assert close(y, y_r, 1e-5 if dtype == mx.float32 else 4e-3)
    assert mx.array_equal(one_at_a_time(q, k, v, g, beta, s0, 16, impl=impl), s).item()
    for n in (0, 1, 9, 16):
        stopped = (
            gd.recurrence(*(x[:, :n] for x in (q, k, v, g, beta)), s0, record=False, impl=impl)[1]
            if n
            else s0
        )
        assert mx.array_equal(
            gd.replay(tape[:, :n], k[:, :n], g[:, :n], s0, impl=impl), stopped
        ).item()
        from_ref_tape = [
            gd.replay(tape_r[:, :n], k[:, :n], g[:, :n], s0, impl=i) for i in (impl, "reference")
        ]
        assert close(*from_ref_tape, 1e-5)


def test_unsupported_shapes_fall_back_to_the_reference():
    q, k, v, g, beta, s0 = inputs(Dk=16, Dv=16)
    y, s, _ = gd.recurrence(q, k, v, g, beta, s0, impl="cuda")  # Dk % 32 != 0: reference
    assert mx.array_equal(s, gated_delta_ops(q, k, v, g, beta, s0)[1]).item()


# -- a real model's cache ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen35_folder(tmp_path_factory):
    return synthetic.save_target(
        tmp_path_factory.mktemp("q35") / "t", synthetic.tiny_qwen3_5_config(layers=8), seed=0
    )


@pytest.fixture(scope="module")
def qwen35_moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q35moe") / "t"
    return synthetic.save_target(folder, synthetic.tiny_qwen3_5_config(moe=True), seed=4)


def _target(folder) -> Target:
    model, _ = mlx_load(str(folder))
    return Target(model, [1, len(model.layers) - 2])


def test_attach_is_per_instance_and_keeps_the_weights(qwen35_folder):
    model, _ = mlx_load(str(qwen35_folder))
    other, _ = mlx_load(str(qwen35_folder))
    names = [n for n, _ in tree_flatten(model.parameters())]
    target = Target(model)
    assert target.hybrid and [n for n, _ in tree_flatten(model.parameters())] == names
    assert type(model.layers[0].linear_attn) is hybrid.TapeGatedDeltaNet
    assert type(other.layers[0].linear_attn) is qwen3_5.GatedDeltaNet  # no class-wide patching
    target.check_cache()  # a hybrid target is accepted
    cache = target.make_cache(Lengths([0]))
    kinds = [type(c).__name__ for c in cache]
    assert kinds == ["TapeCache"] * 3 + ["RaggedKVCache"] + ["TapeCache"] * 3 + ["RaggedKVCache"]


def test_prefill_and_plain_steps_record_no_tape(qwen35_folder):
    target = _target(qwen35_folder)
    lengths = Lengths([0])
    cache = target.make_cache(lengths)
    target(mx.array([list(range(4, 40))]), cache)
    lengths.advance([36])
    target(mx.array([[7]]), cache)
    gdn = [c for c in cache if isinstance(c, hybrid.TapeCache)]
    assert all(c.tape is None and not c.armed for c in gdn)
    with pytest.raises(RuntimeError, match="no tape"):
        target.rollback(cache, [1])


def rollback_check(folder, exact: bool) -> None:
    """After a verify of B rows and a rollback to keep = 0..B, every recurrent and conv state
    equals the state reached by feeding the kept tokens one at a time; so do the KV rows, the
    verify pass's logits and the next step's logits.

    ``exact``: bit for bit. That needs matmuls whose result does not depend on the number of rows
    (MLX's bundled BLAS; OpenBLAS's GEMM and GEMV round differently), so it runs in a subprocess.
    """
    if exact:
        assert loaded_blas() is None

    def same(a, b):
        return (mx.array_equal(a, b) if exact else mx.allclose(a, b, rtol=1e-4, atol=1e-4)).item()

    target = _target(folder)
    prompt = mx.array([[(i * 13) % 500 + 4 for i in range(37)]])
    block = mx.array([[11, 250, 3, 99, 402, 17, 64, 5]])
    B = block.shape[1]

    ref_lengths = Lengths([0])
    ref = target.make_cache(ref_lengths)
    target(prompt, ref)
    ref_lengths.advance([prompt.shape[1]])
    states, step_logits = [[(c[0], c[1]) for c in ref if isinstance(c, hybrid.TapeCache)]], []
    for i in range(B):
        logits, _ = target(block[:, i : i + 1], ref)
        ref_lengths.advance([1])
        step_logits.append(logits)
        states.append([(c[0], c[1]) for c in ref if isinstance(c, hybrid.TapeCache)])
    ref_keys = [c.keys for c in ref if hasattr(c, "keys")]

    for keep in range(B + 1):
        lengths = Lengths([0])
        cache = target.make_cache(lengths)
        target(prompt, cache)
        lengths.advance([prompt.shape[1]])
        logits, _ = target.verify(block, cache)
        assert same(logits, mx.concatenate(step_logits, axis=1))
        target.rollback(cache, [keep])
        lengths.advance([keep])
        gdn = [c for c in cache if isinstance(c, hybrid.TapeCache)]
        for c, (conv, state) in zip(gdn, states[keep]):
            assert same(c[0], conv) and same(c[1], state), keep
            assert not c.armed and c.tape is None
        for c, keys in zip([c for c in cache if hasattr(c, "keys")], ref_keys):
            n = prompt.shape[1] + keep
            assert c.offset == n and same(c.keys[:, :, :n], keys[:, :, :n])
        if keep < B:
            nxt, _ = target(block[:, keep : keep + 1], cache)
            assert same(nxt, step_logits[keep])


@pytest.mark.parametrize("folder", ["qwen35_folder", "qwen35_moe_folder"])
def test_rollback_equals_feeding_the_kept_tokens_one_at_a_time(request, folder):
    rollback_check(request.getfixturevalue(folder), exact=False)


@pytest.mark.parametrize("folder", ["qwen35_folder", "qwen35_moe_folder"])
def test_rollback_is_bit_exact_when_matmuls_are_row_invariant(request, folder):
    path = str(request.getfixturevalue(folder))
    code = f"from tests.test_hybrid import rollback_check; rollback_check({path!r}, exact=True)"
    env = dict(os.environ, DFLASH_BATCH_BLAS="none", HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


# -- greedy DFlash against mlx-lm ---------------------------------------------------------------


def greedy_reference(folder, ids, max_tokens, eos):
    model, _ = mlx_load(str(folder))
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
        if int(tok) in eos:
            break
        out.append(int(tok))
    return out


@pytest.fixture
def scripted(monkeypatch):
    """Drafts = the true continuation with deterministic random corruptions, so that every
    acceptance length 0..B-1 (and full blocks) goes through verify, accept and rollback."""
    return ScriptedDrafts(monkeypatch)


PROMPTS = ["Hi", "Write a haiku about the sea.", "def add(a, b):\n    return a + b\n# now multiply"]


@pytest.mark.parametrize(
    "folder,block", [("qwen35_folder", 8), ("qwen35_folder", 16), ("qwen35_moe_folder", 8)]
)
def test_greedy_dflash_equals_mlx_lm_greedy(request, tmp_path, folder, block, scripted):
    target = request.getfixturevalue(folder)
    cfg = synthetic.tiny_qwen3_5_config(layers=8 if folder == "qwen35_folder" else 4)
    draft = synthetic.save_drafter(
        tmp_path / "d", synthetic.drafter_config(cfg, block_size=block), seed=5
    )
    # given costs: widths, and so the acceptance lengths seen, that no load changes
    engine = load_engine(str(target), str(draft), cost_model=fixed_costs())
    eos = engine.tokenizer.eos_token_ids
    hist = [0] * (block + 1)
    for n, prompt in enumerate(PROMPTS):
        ids = engine.encode(prompt)
        ref = greedy_reference(target, ids, 48, eos)
        scripted(ids + ref + [0] * block, p_wrong=[0.05, 0.2, 0.5][n], seed=n)
        c = engine.generate(ids, max_tokens=48)
        assert c.token_ids == ref, n
        hist = [a + b for a, b in zip(hist, c.stats.acceptance_histogram)]
    assert sum(1 for h in hist[1:] if h) >= 4  # many acceptance lengths were exercised


def test_long_prompt_over_1024_tokens(qwen35_folder, tmp_path, scripted):
    cfg = synthetic.tiny_qwen3_5_config(layers=8)
    draft = synthetic.save_drafter(
        tmp_path / "d", synthetic.drafter_config(cfg, block_size=16), seed=6
    )
    engine = load_engine(str(qwen35_folder), str(draft), prefill_chunk=512)
    ids = [(i * 37) % 500 + 4 for i in range(1100)]
    ref = greedy_reference(qwen35_folder, ids, 40, engine.tokenizer.eos_token_ids)
    scripted(ids + ref + [0] * 16, p_wrong=0.15)
    assert engine.generate(ids, max_tokens=40).token_ids == ref


def test_random_drafter_and_plain_decoding(qwen35_folder, tmp_path):
    cfg = synthetic.tiny_qwen3_5_config(layers=8)
    draft = synthetic.save_drafter(
        tmp_path / "d", synthetic.drafter_config(cfg, block_size=8), seed=7
    )
    ids = list(range(4, 60))
    ref = None
    for engine in (
        load_engine(str(qwen35_folder), str(draft)),
        load_engine(str(qwen35_folder), None),
    ):
        ref = ref or greedy_reference(qwen35_folder, ids, 32, engine.tokenizer.eos_token_ids)
        assert engine.generate(ids, max_tokens=32).token_ids == ref

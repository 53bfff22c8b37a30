"""The CPU ops (engine/ops/kernels/cpu.py, cpu.cpp): MLX's exp-based ops, bit for bit.

Every op must equal MLX's own exactly (``mx.array_equal``, NaNs where MLX has them), over dense
sweeps of its input range and the special values MLX treats apart (exp's cut-offs at +-88,
infinities, NaN, signed zeros), on row lengths that are and are not multiples of the vector
width. A near miss built from the same source (the mutant: one fma of exp unfused, row sums in
two halves) must fail the same comparisons, and the self-check must catch it and fall back to
MLX's ops. The engine's passes must give the same logits, taps and drafts with and without the
ops, on chains, ragged rows and draft trees.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

from dflash_batch.engine import load_engine
from dflash_batch.engine.ops import switch
from dflash_batch.engine.ops.kernels import cpu, selfcheck

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the CPU ops are built for Linux"
    ),
    pytest.mark.usefixtures("fresh_verdicts"),
]

SPECIALS = [
    0.0,
    -0.0,
    88.0,
    -88.0,
    87.99999,
    -87.99999,
    88.00001,
    -88.00001,
    1e-45,
    -1e-45,
    1e-38,
    3.4e38,
    -3.4e38,
    float("inf"),
    -float("inf"),
    float("nan"),
    0.5,
    -0.5,
    1.0,
    -1.0,
]


@pytest.fixture(scope="module")
def ext():
    module = cpu.build()
    assert module is not None
    return module


@pytest.fixture(scope="module")
def mutant():
    return cpu.build(["DFLASH_CPU_OPS_MUTANT=1"])


def identical(a: mx.array, b: mx.array) -> bool:
    """Equal bit for bit up to NaN payloads: the same shape, NaN where the other is NaN, equal elsewhere."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    x, y = np.array(a), np.array(b)
    nan = np.isnan(x)
    return bool(
        (nan == np.isnan(y)).all() and (x[~nan].view(np.uint32) == y[~nan].view(np.uint32)).all()
    )


def sweep(low: float, high: float, count: int) -> mx.array:
    return mx.concatenate([mx.linspace(low, high, count), mx.array(SPECIALS)]).astype(mx.float32)


def rows_case(rows: int, n: int, seed: int, scale: float) -> mx.array:
    """Rows of logits with masked entries (the SDPA mask's finfo.min), and special rows."""
    key = mx.random.key(seed)
    x = mx.random.normal((rows, n), key=key) * scale
    x = mx.where(
        mx.random.uniform(shape=(rows, n), key=mx.random.split(key)[0]) < 0.2,
        mx.finfo(mx.float32).min,
        x,
    )
    return x


def test_the_ops_build_here_and_use_the_vector_units(ext):
    """On this Linux CPU the extension builds and loads; with AVX2 and FMA it is the vector build."""
    assert cpu.load() is not None and cpu.failure() is None
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2" in flags and " fma" in flags:
        assert ext.vectorised


def test_exp_equals_mlx_bit_for_bit(ext):
    x = sweep(-100.0, 100.0, 1 << 22)
    assert identical(ext.exp(x), mx.exp(x))


def test_swiglu_equals_mlx_lms_bit_for_bit(ext):
    g = sweep(-120.0, 120.0, 1 << 20)
    x = mx.random.normal(g.shape, key=mx.random.key(3)) * 4
    assert identical(ext.swiglu(g, x), mlx_lm_swiglu(g, x))
    assert identical(cpu.reference_swiglu(g, x), mlx_lm_swiglu(g, x))


@pytest.mark.parametrize(
    "rows,n", [(1, 1), (3, 7), (8, 8), (9, 9), (17, 316), (11, 333), (2, 16384)]
)
def test_softmax_and_logsumexp_equal_mlx_bit_for_bit(ext, rows, n):
    for seed, scale in ((0, 1.0), (1, 12.0), (2, 60.0)):
        x = rows_case(rows, n, seed, scale)
        assert identical(ext.softmax(x), mx.softmax(x, axis=-1, precise=True)), (seed, scale)
        assert identical(ext.logsumexp(x), mx.logsumexp(x, axis=-1, keepdims=True)), (seed, scale)
    # rows whose logsumexp is about 0, where the sum's last bits show
    x = mx.random.normal((rows, n), key=mx.random.key(7)) * 0.5 - float(np.log(n))
    assert identical(ext.logsumexp(x), mx.logsumexp(x, axis=-1, keepdims=True))


def test_softmax_and_logsumexp_keep_mlxs_special_rows(ext):
    inf, nan = float("inf"), float("nan")
    x = mx.array(
        [
            [-inf] * 9,  # a row masked whole
            [0.0, -inf, 1.0, -inf, 2.0, 3.0, -inf, 4.0, 5.0],
            [1.0, 2.0, nan, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
            [1.0, 2.0, inf, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
            [-0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0],
            [3.4e38, -3.4e38, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        ]
    )
    assert identical(ext.softmax(x), mx.softmax(x, axis=-1, precise=True))
    assert identical(ext.logsumexp(x), mx.logsumexp(x, axis=-1, keepdims=True))


@pytest.mark.parametrize(
    "B,H,Hk,L,N,mask",
    [
        (1, 9, 3, 16, 316, "causal"),
        (1, 9, 3, 1, 316, None),
        (2, 9, 3, 16, 300, "bool-row"),
        (2, 9, 3, 7, 300, "bool-head"),
        (1, 4, 4, 8, 100, None),
        (1, 4, 4, 8, 100, "additive"),
        (3, 2, 1, 5, 40, "causal"),
    ],
)
def test_sdpa_equals_mlxs_on_the_cpu(B, H, Hk, L, N, mask):
    key = mx.random.key(B * 100 + L)
    q, k, v = (
        mx.random.normal(s, key=kk)
        for s, kk in zip(((B, H, L, 64), (B, Hk, N, 64), (B, Hk, N, 64)), mx.random.split(key, 3))
    )
    m = mask
    if mask == "bool-row":
        m = mx.random.uniform(shape=(B, 1, L, N), key=key) > 0.3
    elif mask == "bool-head":
        m = mx.random.uniform(shape=(B, H, L, N), key=key) > 0.3
    elif mask == "additive":
        m = mx.random.normal((L, N), key=key)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)
    with switch.modes(cpu_ops="native"):
        before = cpu.counters()["softmax"]
        got = cpu.sdpa(q, k, v, 0.125, m)
        assert cpu.counters()["softmax"] == before + 1
    assert identical(got, want)


# -- the negative control ----------------------------------------------------------------------------


def test_the_mutant_fails_the_same_comparisons(mutant):
    x = sweep(-100.0, 100.0, 1 << 22)
    assert not identical(mutant.exp(x), mx.exp(x))
    g = sweep(-120.0, 120.0, 1 << 20)
    assert not identical(mutant.swiglu(g, g), mlx_lm_swiglu(g, g))
    rows = rows_case(17, 316, 1, 12.0)
    assert not identical(mutant.softmax(rows), mx.softmax(rows, axis=-1, precise=True))
    # logsumexp rounds a sum's last bits away unless the result is small: rows whose sum is about 1
    rows = mx.random.normal((256, 316), key=mx.random.key(4)) * 0.5 - float(np.log(316))
    assert not identical(mutant.logsumexp(rows), mx.logsumexp(rows, axis=-1, keepdims=True))


def test_a_mutant_fails_its_self_check_and_mlxs_ops_run(mutant, monkeypatch):
    monkeypatch.setattr(cpu, "_module", mutant)
    monkeypatch.setattr(cpu, "load", lambda: mutant)
    x = rows_case(17, 316, 1, 12.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [cpu.softmax(x) for _ in range(3)]
    assert all(identical(o, mx.softmax(x, axis=-1, precise=True)) for o in outs)
    assert len([w for w in caught if "cpu kernel 'softmax'" in str(w.message)]) == 1
    assert selfcheck.verdicts()[("softmax", "cpu", ("dtype", "float32"))] is False


def test_without_a_compiler_mlxs_ops_run_after_one_warning(monkeypatch):
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_failure", None)
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    x = rows_case(4, 33, 0, 3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [cpu.softmax(x), cpu.logsumexp(x), cpu.swiglu(x, x)]
    assert "no C++ compiler" in cpu.failure()
    assert len([w for w in caught if "could not be built or loaded" in str(w.message)]) == 1
    assert identical(outs[0], mx.softmax(x, axis=-1, precise=True))
    assert identical(outs[1], mx.logsumexp(x, axis=-1, keepdims=True))
    assert identical(outs[2], mlx_lm_swiglu(x, x))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_build_error_is_reported_not_raised(monkeypatch, tmp_path):
    broken = tmp_path / "cpu.cpp"
    broken.write_text(cpu.SOURCE.read_text() + "\nthis is not C++;\n")
    monkeypatch.setattr(cpu, "SOURCE", broken)
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_failure", None)
    with pytest.warns(RuntimeWarning, match="could not be built or loaded"):
        assert cpu.load() is None
    assert "failed" in cpu.failure()


# -- the engine's passes -------------------------------------------------------------------------------


def _passes(engine, cpu_ops: str):
    """A prefill, a chain verify pass of 16 rows, a ragged two-row pass, a draft-tree pass and a
    drafter pass, all under one mode of the CPU ops: their outputs."""
    from dflash_batch.engine import decode, tree
    from dflash_batch.engine.ops.batch_cache import Lengths

    from tests.helpers import TREE_PROMPT, branchy_trees, prefilled, tree_pass

    target, out = engine.target, []
    with switch.modes(cpu_ops=cpu_ops):
        cache, lengths = prefilled(target, TREE_PROMPT)
        out += list(target.verify(mx.array([list(range(40, 56))]), cache))
        cache, lengths = prefilled(target, TREE_PROMPT, 2)
        out += list(target.verify(mx.array([list(range(40, 45)), list(range(50, 55))]), cache))
        cache, lengths = prefilled(target, TREE_PROMPT, 2)
        out += list(tree_pass(target, cache, lengths, branchy_trees()))
        hidden = out[1]
        drafter = engine.drafter
        dcache = drafter.make_cache(Lengths([0]))
        ids, logprobs = decode.draft_candidates(
            drafter,
            target,
            mx.array([[7]]),
            hidden[:, :5],
            None,
            dcache,
            8,
            tree.CANDIDATES,
            engine.draft_head,
        )
        out += [ids, logprobs]
    mx.eval(out)
    return out


def test_the_engines_passes_are_the_same_with_and_without_the_ops(tiny_pair):
    engine = load_engine(*map(str, tiny_pair))
    before = cpu.counters()
    native = _passes(engine, "native")
    used = {k: cpu.counters()[k] - before[k] for k in before}
    assert used["softmax"] > 0 and used["swiglu"] > 0 and used["logsumexp"] > 0, used
    stock = _passes(engine, "mlx")
    assert cpu.counters() == {k: before[k] + used[k] for k in before}  # "mlx": none of them ran
    for a, b in zip(native, stock):
        assert identical(a, b)


def test_stock_ops_turn_the_ops_off():
    with switch.modes(cpu_ops="native"):
        assert cpu.active() == (mx.default_device() == mx.cpu)
        with switch.stock_ops():
            assert not cpu.active()
        assert cpu.active() == (mx.default_device() == mx.cpu)


def test_the_models_swiglu_is_routed_only_while_the_ops_are_active(tiny_pair):
    """After the engine installs it, mlx-lm's MLP runs the routed swiglu: the CPU op in "native"
    mode, mlx-lm's own under stock_ops (the benchmarks' baselines)."""
    from dflash_batch.engine.ops import activations

    engine = load_engine(*map(str, tiny_pair))
    layer = engine.target.layers[0]
    mlp = getattr(layer, "layer", layer).mlp
    x = mx.random.normal((1, 3, mlp.gate_proj.weight.shape[1]), key=mx.random.key(5))
    owner = sys.modules[type(mlp).__module__]
    assert owner.swiglu is activations.routed_swiglu
    counts = cpu.counters()["swiglu"]
    with switch.modes(cpu_ops="native"):
        a = mlp(x)
    assert cpu.counters()["swiglu"] == counts + 1
    with switch.stock_ops():
        b = mlp(x)
    assert cpu.counters()["swiglu"] == counts + 1
    assert identical(a, b) and isinstance(mlp, nn.Module)


def test_gradients_through_the_ops_are_mlxs(ext):
    """Drafter training takes gradients through the drafter's passes: each op's vjp is MLX's own
    op's, bit for bit."""
    x, u = (mx.random.normal((4, 9), key=mx.random.key(s)) for s in (8, 9))
    w = mx.arange(9, dtype=mx.float32)
    pairs = [
        (lambda a, b: ext.swiglu(a, b), cpu.reference_swiglu),
        (lambda a, b: ext.softmax(a) * b, lambda a, b: mx.softmax(a, axis=-1, precise=True) * b),
        (
            lambda a, b: ext.logsumexp(a * b) * b,
            lambda a, b: mx.logsumexp(a * b, axis=-1, keepdims=True) * b,
        ),
    ]
    for ours, theirs in pairs:
        got = mx.grad(lambda a, b: (ours(a, b) * w).sum(), argnums=(0, 1))(x, u)
        want = mx.grad(lambda a, b: (theirs(a, b) * w).sum(), argnums=(0, 1))(x, u)
        assert all(identical(g, h) for g, h in zip(got, want))


def test_the_engine_says_which_ops_it_runs(tiny_pair):
    """Engine.description["cpu_ops"]: "native" on this Linux CPU (loaded with the engine), "mlx"
    when turned off, and why where they cannot be had."""
    assert load_engine(*map(str, tiny_pair)).description["cpu_ops"] == (
        "native" if mx.default_device() == mx.cpu else None
    )
    assert load_engine(*map(str, tiny_pair), cpu_ops="mlx").description["cpu_ops"] == "mlx"


def test_an_engine_that_cannot_have_the_ops_says_why(tiny_pair, monkeypatch):
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_failure", "no C++ compiler (g++, c++ or clang++; or set CXX)")
    assert (
        load_engine(*map(str, tiny_pair)).description["cpu_ops"]
        == "mlx (no C++ compiler (g++, c++ or clang++; or set CXX))"
    )

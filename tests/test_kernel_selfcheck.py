"""The kernels' self-check (engine/ops/kernels/selfcheck.py), on the CPU with stand-in "kernels".

No GPU is needed: the tests register, for the metal backend, deliberately broken kernels (the
reference's output plus noise, kernels broken for one mask or tape flag only, one that raises as
a compile error does) in the ``LAUNCHERS`` tables that the public ops dispatch through, then call
the public ops (``gated_delta.recurrence`` / ``replay`` with impl="metal", the engine's attention
routing in "kernel" mode with the backend taken for Metal). A failing kernel must give the
reference's output, exactly one warning across several calls, and a cached verdict; a kernel
within tolerance must pass with no warning and serve the calls itself. The shipped launchers,
asked for Metal where MLX has no Metal back-end, must fall back the same way; where Metal or
CUDA exists, the real kernels must pass their own self-check.
"""

from __future__ import annotations

import warnings

from dflash_batch.engine.ops import attention as routing
from dflash_batch.engine.ops import device, switch
from dflash_batch.engine.ops.kernels import attention as ka
from dflash_batch.engine.ops.kernels import gated_delta as gd
from dflash_batch.engine.ops.kernels import selfcheck

import mlx.core as mx
import pytest

from dflash_batch import paths
from tests.helpers import gated_delta_inputs as hybrid_inputs

pytestmark = pytest.mark.usefixtures("fresh_verdicts")


class Spy:
    """A stand-in kernel: ``fn`` applied to the arguments, counting its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def noise_like(x, size, seed=1):
    return (size * mx.random.normal(x.shape, key=mx.random.key(seed))).astype(x.dtype)


def collect(calls):
    """Run each call with every warning recorded; returns (results, warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [call() for call in calls]
    return results, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def gdn_inputs(T, seed, Hk=2, Hv=4, Dk=64, Dv=32, dtype=mx.float32):
    """test_hybrid's seeded GatedDeltaNet case, at this file's default head dims."""
    return hybrid_inputs(T, Hk, Hv, Dk, Dv, dtype, seed)


def same(a, b):
    return all((x is None and y is None) or mx.array_equal(x, y).item() for x, y in zip(a, b))


# -- the rule ----------------------------------------------------------------------------------


def test_the_rule_caches_the_verdict_and_warns_once():
    out = mx.arange(8, dtype=mx.float32)
    kernel = Spy(lambda: {"out": out + 0.5})
    key = (("dtype", mx.float32), ("head_dim", 8))
    results, caught = collect(
        [lambda: selfcheck.verified("k", "metal", key, kernel, lambda: {"out": out}, 1e-4)] * 3
    )
    assert results == [False] * 3 and kernel.calls == 1 and len(caught) == 1
    text = str(caught[0].message)
    assert "metal kernel 'k'" in text and "dtype=float32, head_dim=8" in text
    assert "max difference 0.5" in text and "pure-MLX reference (slower) runs instead" in text
    assert selfcheck.verdicts() == {("k", "metal") + key: False}
    assert selfcheck.known("k", "metal", key) is False


@pytest.mark.parametrize(
    "bad, why",
    [
        (lambda out: out * float("nan"), "max difference nan"),
        (lambda out: out[:4], "output 'out' is float32 (4,)"),
        (lambda out: out.astype(mx.float16), "output 'out' is float16"),
    ],
)
def test_nan_shape_and_dtype_mismatches_fail(bad, why):
    out = mx.arange(1, 9, dtype=mx.float32)
    _, caught = collect(
        [
            lambda: selfcheck.verified(
                "k", "cuda", (), lambda: {"out": bad(out)}, lambda: {"out": out}, 1.0
            )
        ]
    )
    assert len(caught) == 1 and why in str(caught[0].message)


def test_tolerance_is_relative_to_the_largest_reference_entry():
    out = mx.array([1000.0, 1.0])
    near = lambda: {"out": out + mx.array([0.0, 0.09])}  # noqa: E731  (9e-5 of 1000)
    far = lambda: {"out": out + mx.array([0.0, 0.11])}  # noqa: E731
    (ok, bad), caught = collect(
        [
            lambda: selfcheck.verified("a", "metal", (), near, lambda: {"out": out}, 1e-4),
            lambda: selfcheck.verified("b", "metal", (), far, lambda: {"out": out}, 1e-4),
        ]
    )
    assert ok and not bad and len(caught) == 1
    assert (
        selfcheck.tolerance(mx.float32)
        < selfcheck.tolerance(mx.float16)
        < selfcheck.tolerance(mx.bfloat16)
    )
    assert selfcheck.tolerance(mx.float32, mx.bfloat16) == selfcheck.TOLERANCE[mx.bfloat16]


def test_switched_off_by_the_environment(monkeypatch):
    kernel = Spy(lambda: {"out": mx.zeros(3)})
    monkeypatch.setenv(selfcheck.ENV, "0")
    assert selfcheck.verified("k", "metal", (), kernel, lambda: {"out": mx.ones(3)}, 1e-4)
    assert kernel.calls == 0 and selfcheck.verdicts() == {}
    monkeypatch.setenv(selfcheck.ENV, "yes")
    with pytest.raises(ValueError, match=selfcheck.ENV):
        selfcheck.enabled()


# -- GatedDeltaNet recurrence and replay -------------------------------------------------------


def noisy_recurrence(impl, q, k, v, g, beta, state, record):
    """The reference's result, then each output moved by 1% of its scale: a broken kernel."""
    y, s, tape = gd._reference_recurrence(q, k, v, g, beta, state, record)
    return (
        y + noise_like(y, 0.01),
        s + noise_like(s, 0.01),
        None if tape is None else tape + noise_like(tape, 0.01),
    )


def raising(*args, **kwargs):
    raise RuntimeError(
        "[metal::Device] Unable to build metal library from source\nerror: use of undeclared identifier 'simd_sum'"
    )


@pytest.mark.parametrize(
    "broken, why", [(noisy_recurrence, "max difference"), (raising, "undeclared identifier")]
)
def test_broken_metal_recurrence_falls_back_to_the_reference(monkeypatch, broken, why):
    kernel = Spy(broken)
    monkeypatch.setitem(gd.LAUNCHERS, ("metal", "recurrence"), kernel)
    cases = [gdn_inputs(T, seed) for T, seed in ((16, 0), (1, 1), (5, 2))]
    results, caught = collect([lambda c=c: gd.recurrence(*c, impl="metal") for c in cases])
    for c, got in zip(cases, results):
        assert same(got, gd.recurrence(*c, impl="reference"))
    assert kernel.calls == 1  # the check only; never again
    assert len(caught) == 1
    text = str(caught[0].message)
    assert (
        "metal kernel 'gated_delta recurrence'" in text
        and why in text
        and "runs instead for such calls" in text
    )
    assert "Dk=64, Dv=32, record=True" in text
    assert list(selfcheck.verdicts().values()) == [False]


def test_record_flag_is_checked_on_its_own(monkeypatch):
    """Record is a compile-time flag: a kernel broken only without the tape fails only there."""

    def broken_without_tape(impl, q, k, v, g, beta, state, record):
        out = gd._reference_recurrence(q, k, v, g, beta, state, record)
        return out if record else (out[0], out[1] * 2, None)

    monkeypatch.setitem(gd.LAUNCHERS, ("metal", "recurrence"), Spy(broken_without_tape))
    c = gdn_inputs(4, 0)
    _, caught = collect(
        [
            lambda: gd.recurrence(*c, record=True, impl="metal"),
            lambda: gd.recurrence(*c, record=False, impl="metal"),
        ]
        * 2
    )
    assert len(caught) == 1 and "record=False" in str(caught[0].message)
    assert sorted(selfcheck.verdicts().values()) == [False, True]


def test_correct_metal_recurrence_passes_and_serves_the_calls(monkeypatch):
    """A stand-in within tolerance (the reference plus 1e-6 relative noise, as a different
    summation order gives) passes without a warning, and its own outputs come back."""

    def close(impl, q, k, v, g, beta, state, record):
        y, s, tape = gd._reference_recurrence(q, k, v, g, beta, state, record)
        return y + noise_like(y, 1e-6), s + noise_like(s, 1e-6), tape + noise_like(tape, 1e-6)

    kernel = Spy(close)
    monkeypatch.setitem(gd.LAUNCHERS, ("metal", "recurrence"), kernel)
    cases = [gdn_inputs(T, seed) for T, seed in ((16, 0), (3, 1))]
    results, caught = collect([lambda c=c: gd.recurrence(*c, impl="metal") for c in cases])
    assert caught == [] and kernel.calls == 3  # the check, then both calls
    for c, got in zip(cases, results):
        assert same(got, close("metal", *c, True))
        assert not same(got, gd.recurrence(*c, impl="reference"))
    assert list(selfcheck.verdicts().values()) == [True]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_reduced_precision_tolerance_passes_one_rounding_and_fails_a_fault(
    monkeypatch, tmp_path, dtype
):
    """bf16 / fp16 y: one extra rounding step of y (what a kernel's different summation order can
    give) passes; y scaled by 1.1 fails."""
    for scale, passes in ((1.0, True), (1.1, False)):
        # each stand-in is another kernel under one source hash: a folder of its own, so that
        # the first one's kept pass does not stand for the second
        selfcheck.reset()
        monkeypatch.setattr(paths, "kernel_checks_dir", lambda scale=scale: tmp_path / str(scale))

        def kernel(impl, q, k, v, g, beta, state, record, scale=scale):
            y, s, tape = gd._reference_recurrence(q, k, v, g, beta, state, record)
            y32 = y.astype(mx.float32)
            ulp = mx.abs(y32) * (2.0**-7 if dtype == mx.bfloat16 else 2.0**-10)
            return (y32 * scale + 0.5 * ulp).astype(dtype), s, tape

        monkeypatch.setitem(gd.LAUNCHERS, ("metal", "recurrence"), kernel)
        c = gdn_inputs(4, 0, dtype=dtype)
        _, caught = collect([lambda: gd.recurrence(*c, impl="metal")])
        assert (len(caught) == 0) == passes, (scale, [str(w.message) for w in caught])


@pytest.mark.parametrize("mode", ["noisy", "raises", "correct"])
def test_metal_replay_is_checked(monkeypatch, mode):
    def noisy(impl, tape, k, g, state):
        s = gd._reference_replay(tape, k, g, state)
        return s + noise_like(s, 0.01 if mode == "noisy" else 1e-7)

    kernel = Spy(raising if mode == "raises" else noisy)
    monkeypatch.setitem(gd.LAUNCHERS, ("metal", "replay"), kernel)
    q, k, v, g, beta, s0 = gdn_inputs(8, 3)
    _, _, tape = gd.recurrence(q, k, v, g, beta, s0, impl="reference")
    calls = [
        lambda n=n: gd.replay(tape[:, :n], k[:, :n], g[:, :n], s0, impl="metal") for n in (8, 3, 1)
    ]
    results, caught = collect(calls)
    if mode == "correct":
        assert caught == [] and kernel.calls == 4
        assert not mx.array_equal(results[0], gd.replay(tape, k, g, s0, impl="reference")).item()
    else:
        assert len(caught) == 1 and "metal kernel 'gated_delta replay'" in str(caught[0].message)
        assert kernel.calls == 1
        for n, got in zip((8, 3, 1), results):
            assert mx.array_equal(
                got, gd.replay(tape[:, :n], k[:, :n], g[:, :n], s0, impl="reference")
            ).item()


def test_unchecked_runs_the_raw_kernel(monkeypatch):
    kernel = Spy(noisy_recurrence)
    monkeypatch.setitem(gd.LAUNCHERS, ("metal", "recurrence"), kernel)
    c = gdn_inputs(4, 0)
    with selfcheck.unchecked():
        results, caught = collect([lambda: gd.recurrence(*c, impl="metal")])
    assert caught == [] and kernel.calls == 1 and selfcheck.verdicts() == {}
    assert not same(results[0], gd.recurrence(*c, impl="reference"))


@pytest.mark.skipif(gd.backend() == "reference", reason="needs the CUDA or Metal backend")
@pytest.mark.parametrize(
    "dtype, state_dtype",
    [(mx.float32, mx.float32), (mx.bfloat16, mx.float32), (mx.bfloat16, mx.bfloat16)],
)
def test_real_gated_delta_kernels_pass_their_self_check(dtype, state_dtype):
    q, k, v, g, beta, s0 = gdn_inputs(4, 0, Hk=2, Hv=4, Dk=128, Dv=64, dtype=dtype)
    s0 = s0.astype(state_dtype)
    _, caught = collect(
        [lambda: gd.recurrence(q, k, v, g, beta, s0, record=r) for r in (True, False)]
        + [lambda: gd.replay(mx.zeros((1, 4, 4, 64)), k, g, s0)]
    )
    assert caught == [], str(caught[0].message)
    assert len(selfcheck.verdicts()) == 3 and all(selfcheck.verdicts().values())


# -- block attention through the engine's routing ----------------------------------------------


@pytest.fixture
def metal_routing(monkeypatch):
    """The routing in "kernel" mode, with this CPU device taken for a Metal backend."""
    monkeypatch.setitem(device._known, mx.default_device().type, "metal")
    with switch.modes(attention="kernel"):
        yield


def attention_calls(window):
    """Three routed calls: the drafter's (bidirectional or sliding window) at two key lengths,
    one target verify; each returns (output, reference output)."""
    calls = []
    for Lk, seed in ((40, 0), (57, 1)):
        mx.random.seed(seed)
        q = mx.random.normal((1, 4, 8, 64))
        k, v = mx.random.normal((1, 2, Lk, 64)), mx.random.normal((1, 2, Lk, 64))
        calls.append(
            lambda q=q, k=k, v=v: (
                routing.drafter_attention(q, k, v, scale=0.125, window=window),
                ka.block_attention_reference(
                    q, k, v, scale=0.125, causal=window is not None, window=window
                ),
            )
        )
    return calls


def broken_attention(q, k, v, *, scale, causal, window, kv_start, **kw):
    out = ka.block_attention_reference(
        q, k, v, scale=scale, causal=causal, window=window, kv_start=kv_start
    )
    return out + noise_like(out, 0.05)


@pytest.mark.parametrize(
    "broken, why", [(broken_attention, "max difference"), (raising, "undeclared identifier")]
)
def test_broken_metal_attention_falls_back_to_the_reference(
    metal_routing, monkeypatch, broken, why
):
    kernel = Spy(broken)
    monkeypatch.setitem(ka.LAUNCHERS, "metal", kernel)
    routed = routing.counters()["routed"]
    results, caught = collect(attention_calls(window=None) + attention_calls(window=None))
    assert routing.counters()["routed"] == routed + 4
    for got, want in results:
        assert mx.array_equal(got, want).item()
    assert kernel.calls == 1 and len(caught) == 1
    text = str(caught[0].message)
    assert "metal kernel 'block attention'" in text and why in text
    assert "dtype=float32, head_dim=64, causal=False, window=False, kv_start=False" in text


def test_attention_mask_flags_are_checked_separately(metal_routing, monkeypatch):
    """A kernel broken only for sliding windows serves bidirectional calls and is replaced by
    the reference for windowed ones; the check case uses the window, with one warning."""

    def broken_window(q, k, v, *, scale, causal, window, kv_start, **kw):
        return ka.block_attention_reference(
            q, k, v, scale=scale, causal=causal, window=None, kv_start=kv_start
        )

    kernel = Spy(broken_window)
    monkeypatch.setitem(ka.LAUNCHERS, "metal", kernel)
    full, caught_full = collect(attention_calls(window=None))
    windowed, caught_window = collect(attention_calls(window=4) * 2)
    assert (
        caught_full == []
        and len(caught_window) == 1
        and "window=True" in str(caught_window[0].message)
    )
    assert kernel.calls == 1 + 2 + 1  # check and calls (bidirectional), check only (window)
    for got, want in full + windowed:
        assert mx.allclose(got, want, atol=1e-6).item()


def test_left_padding_is_checked_separately(metal_routing, monkeypatch):
    """A kernel that ignores kv_start serves unpadded calls; padded ones get the reference."""

    def broken_padding(q, k, v, *, scale, causal, window, kv_start, **kw):
        return ka.block_attention_reference(q, k, v, scale=scale, causal=causal, window=window)

    kernel = Spy(broken_padding)
    monkeypatch.setitem(ka.LAUNCHERS, "metal", kernel)
    monkeypatch.setattr(ka, "gpu_backend", lambda: "metal")
    mx.random.seed(5)
    q, k, v = (
        mx.random.normal((2, 8, 4, 64)),
        mx.random.normal((2, 4, 30, 64)),
        mx.random.normal((2, 4, 30, 64)),
    )
    starts = mx.array([12, 0], dtype=mx.int32)
    calls = [
        lambda: ka.block_attention(q, k, v, scale=0.1),
        lambda: ka.block_attention(q, k, v, scale=0.1, kv_start=starts),
    ]
    (plain, padded, _, _), caught = collect(calls * 2)
    assert len(caught) == 1 and "kv_start=True" in str(caught[0].message)
    assert kernel.calls == 1 + 1 + 1 + 0 + 1  # check and call (plain), check (padded), call (plain)
    assert mx.array_equal(
        padded, ka.block_attention_reference(q, k, v, scale=0.1, kv_start=starts)
    ).item()
    assert mx.array_equal(plain, ka.block_attention_reference(q, k, v, scale=0.1)).item()


@pytest.mark.parametrize("honours_lengths", [False, True])
def test_row_lengths_are_checked_separately(metal_routing, monkeypatch, honours_lengths):
    """A kernel that ignores kv_len serves calls without it (padded or not); calls with kv_len get
    the reference, one warning per kind of call. A kernel that honours kv_len serves them all."""

    def stand_in(q, k, v, *, scale, causal, window, kv_start, kv_len=None, **kw):
        return ka.block_attention_reference(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            window=window,
            kv_start=kv_start,
            kv_len=kv_len if honours_lengths else None,
        )

    kernel = Spy(stand_in)
    monkeypatch.setitem(ka.LAUNCHERS, "metal", kernel)
    monkeypatch.setattr(ka, "gpu_backend", lambda: "metal")
    mx.random.seed(7)
    q, k, v = (
        mx.random.normal((2, 8, 4, 64)),
        mx.random.normal((2, 4, 30, 64)),
        mx.random.normal((2, 4, 30, 64)),
    )
    lengths, starts = mx.array([30, 11], dtype=mx.int32), mx.array([0, 3], dtype=mx.int32)
    kinds = [
        dict(),
        dict(kv_start=starts),
        dict(kv_len=lengths),
        dict(kv_start=starts, kv_len=lengths),
    ]
    results, caught = collect(
        [lambda kw=kw: ka.block_attention(q, k, v, scale=0.1, **kw) for kw in kinds] * 2
    )
    for kw, got in zip(kinds * 2, results):
        assert mx.array_equal(got, ka.block_attention_reference(q, k, v, scale=0.1, **kw)).item()
    if honours_lengths:
        assert caught == [] and kernel.calls == 4 + 8  # a check per kind, then every call
    else:
        assert len(caught) == 2 and all("kv_len=True" in str(w.message) for w in caught)
        assert "kv_start=False, kv_len=True" in str(caught[0].message)
        assert "kv_start=True, kv_len=True" in str(caught[1].message)
        assert kernel.calls == 4 + 4  # a check per kind; then the calls without kv_len only
    assert sorted(v for v in selfcheck.verdicts().values()) == [honours_lengths] * 2 + [True] * 2


def test_row_lengths_check_case_has_rows_of_their_own_lengths():
    """The check case with kv_len: B = 2, rows of 83 and 61 keys over 96 keys (a view of a longer
    buffer), on which a kernel that ignores kv_len differs from the reference by far more than the
    tolerance."""
    q, k, v, kw = ka._check_case(mx.float32, 64, True, False, False, True)
    assert k.shape == v.shape == (2, 2, 96, 64)
    assert kw["kv_len"].tolist() == [83, 61] and kw["kv_start"] is None
    with_lengths = ka.block_attention_reference(q, k, v, **kw)
    without = ka.block_attention_reference(q, k, v, **{**kw, "kv_len": None})
    assert mx.abs(with_lengths - without).max().item() > 100 * selfcheck.tolerance(mx.float32)


def test_correct_metal_attention_passes_and_serves_the_calls(metal_routing, monkeypatch):
    def close(q, k, v, *, scale, causal, window, kv_start, **kw):
        out = ka.block_attention_reference(
            q, k, v, scale=scale, causal=causal, window=window, kv_start=kv_start
        )
        return out + noise_like(out, 1e-6)

    kernel = Spy(close)
    monkeypatch.setitem(ka.LAUNCHERS, "metal", kernel)
    results, caught = collect(attention_calls(window=8))
    assert caught == [] and kernel.calls == 3
    for got, want in results:
        assert not mx.array_equal(got, want).item() and mx.allclose(got, want, atol=1e-5).item()


def test_target_verify_and_block_attention_are_checked(metal_routing, monkeypatch):
    """target_sdpa (mask "causal") and kernels.attention.block_attention with left padding."""
    kernel = Spy(broken_attention)
    monkeypatch.setitem(ka.LAUNCHERS, "metal", kernel)
    monkeypatch.setattr(ka, "gpu_backend", lambda: "metal")
    mx.random.seed(4)
    q, k, v = (
        mx.random.normal((2, 4, 16, 128)),
        mx.random.normal((2, 2, 50, 128)),
        mx.random.normal((2, 2, 50, 128)),
    )
    starts = mx.array([0, 9], dtype=mx.int32)
    (verify, padded), caught = collect(
        [
            lambda: routing.target_sdpa(q, k, v, cache=None, scale=0.1, mask="causal"),
            lambda: ka.block_attention(q, k, v, scale=0.1, causal=True, kv_start=starts),
        ]
    )
    assert mx.array_equal(
        verify, ka.block_attention_reference(q, k, v, scale=0.1, causal=True)
    ).item()
    assert mx.array_equal(
        padded, ka.block_attention_reference(q, k, v, scale=0.1, causal=True, kv_start=starts)
    ).item()
    assert len(caught) == 2 and kernel.calls == 2  # two kinds of call: no padding, padding
    assert "kv_start=True" in str(caught[1].message)


@pytest.mark.skipif(ka.gpu_backend() is None, reason="needs the CUDA or Metal backend")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("D", ka.HEAD_DIMS)
def test_real_attention_kernels_pass_their_self_check(dtype, D):
    q = mx.zeros((1, 4, 16, D), dtype=dtype)
    start, length = mx.array([0], dtype=mx.int32), mx.array([0], dtype=mx.int32)
    for causal, window, kv_start, kv_len in (
        (True, None, None, None),
        (False, None, None, None),
        (True, 64, None, None),
        (True, None, start, None),
        (True, None, None, length),
        (False, None, None, length),
        (True, 64, start, length),
    ):
        _, caught = collect(
            [
                lambda: ka.kernel_verified(
                    q, causal=causal, window=window, kv_start=kv_start, kv_len=kv_len
                )
            ]
        )
        assert caught == [], str(caught[0].message)
    assert all(selfcheck.verdicts().values())


# -- the shipped launchers where MLX has no Metal back-end ------------------------------------


@pytest.mark.skipif(mx.metal.is_available(), reason="needs a machine without Metal")
def test_real_metal_launchers_without_metal_fall_back(monkeypatch):
    """The shipped launchers, asked for Metal where MLX has no Metal back-end: MLX raises when
    the kernel is built or run, as on a compile error; every op falls back with one warning each."""
    monkeypatch.setattr(ka, "gpu_backend", lambda: "metal")
    q, k, v, g, beta, s0 = gdn_inputs(5, 0)
    _, _, tape = gd.recurrence(q, k, v, g, beta, s0, impl="reference")
    mx.random.seed(6)
    aq, ak, av = (
        mx.random.normal((1, 4, 8, 64)),
        mx.random.normal((1, 2, 20, 64)),
        mx.random.normal((1, 2, 20, 64)),
    )
    results, caught = collect(
        [
            lambda: gd.recurrence(q, k, v, g, beta, s0, impl="metal"),
            lambda: gd.replay(tape, k, g, s0, impl="metal"),
            lambda: ka.block_attention(aq, ak, av, scale=0.125),
        ]
        * 2
    )
    assert same(results[0], gd.recurrence(q, k, v, g, beta, s0, impl="reference"))
    assert mx.array_equal(results[1], gd.replay(tape, k, g, s0, impl="reference")).item()
    assert mx.array_equal(results[2], ka.block_attention_reference(aq, ak, av, scale=0.125)).item()
    assert len(caught) == 3 and all("it raised" in str(w.message) for w in caught)
    assert list(selfcheck.verdicts().values()) == [False] * 3

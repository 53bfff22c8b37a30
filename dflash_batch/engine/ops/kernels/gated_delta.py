"""The GatedDeltaNet recurrence with an innovation tape, and the tape replay that rolls it back.

Per step t, with state S [Dv, Dk] per value head (mlx-lm's layout [B, Hv, Dv, Dk]):

    S'    = g_t * S_{t-1}                      decay
    delta = beta_t * (v_t - S' k_t)            the innovation (fp32): what step t writes
    S_t   = S' + delta k_t^T                   (S'[i, j] + delta[i] * k_t[j])
    y_t   = S_t q_t

and S_t is rounded to the state's storage dtype after every step, as token-by-token decoding
stores it between calls. Given S_0 and the tape (delta_t, k_t, g_t), S_t is rebuilt without
q, v or beta:  ``replay``:  S_t = g_t * S_{t-1} + delta_t k_t^T.

Two functions, three implementations each, chosen by backend:

- ``recurrence(q, k, v, g, beta, state, record)`` -> (y, state, tape or None)
- ``replay(tape, k, g, state)`` -> state

``reference``: pure MLX, one compiled step per token, the same operations in the same order as
mlx-lm's own step (``_gated_delta_step_ops``) so that on CPU it is bit-identical to it; the test
oracle. ``metal``: ``mx.fast.metal_kernel`` (one simdgroup per state row). ``cuda``:
``mx.fast.cuda_kernel`` (one warp per state row). Kernels need Dk % 32 == 0 and Dv % 4 == 0,
scalar gates and no mask; other shapes use the reference.

Before a kernel serves its first call of a kind (dtypes, head counts and dims, ``record``), it
checks itself once per machine against the reference on a small seeded case of that kind
(``selfcheck``: T = CHECK_STEPS, B = 1); on a compile error or a mismatch it warns once and the
reference serves those calls instead. The Metal kernels have never run on Apple hardware: this
check is what stands between them and a wrong result there. ``LAUNCHERS`` holds the function
that runs each kernel (tests register deliberately broken ones there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx

from .. import device
from . import selfcheck, sources

IMPLEMENTATIONS = ("reference", "metal", "cuda")
CHECK_STEPS = 4  # tokens in a self-check case


def backend() -> str:
    """The implementation the current default device runs."""
    return device.gpu() or "reference"


def cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)  # absent from some MLX builds
    return cuda is not None and cuda.is_available()


def _pick(impl: Optional[str], k: mx.array, v: mx.array, g: mx.array) -> str:
    impl = impl or backend()
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
    if impl != "reference" and (k.shape[-1] % 32 or v.shape[-1] % 4 or g.ndim != 3):
        return "reference"
    return impl


# ---------------------------------------------------------------------------------------------
# Reference (pure MLX)


@mx.compile
def _reference_step(q, k, v, g, beta, state):
    """One token. q, k: [B, Hv, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv]; state: [B, Hv, Dv, Dk]."""
    state = state * g[..., None, None]  # S' = g S
    kv_mem = (state * k[..., None, :]).sum(axis=-1)  # S' k
    delta = (v - kv_mem) * beta[..., None]  # beta (v - S' k)
    state = state + k[..., None, :] * delta[..., None]  # S' + delta k^T
    y = (state * q[..., None, :]).sum(axis=-1)  # S q
    return y.astype(q.dtype), state, delta


@mx.compile
def _reference_replay_step(k, g, delta, state):
    state = state * g[..., None, None]
    return state + k[..., None, :] * delta[..., None]


def _round_to(state: mx.array, dtype: mx.Dtype) -> mx.array:
    return state if state.dtype == dtype else state.astype(dtype)


def _repeat_heads(x: mx.array, hv: int) -> mx.array:
    """[B, T, Hk, D] -> [B, T, Hv, D]: value head h reads key head h // (Hv / Hk)."""
    factor = hv // x.shape[2]
    return mx.repeat(x, factor, axis=2) if factor > 1 else x


def _reference_recurrence(q, k, v, g, beta, state, record):
    store = state.dtype
    q, k = _repeat_heads(q, v.shape[2]), _repeat_heads(k, v.shape[2])
    ys, deltas = [], []
    for t in range(q.shape[1]):
        y, new, delta = _reference_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        state = _round_to(new, store)
        ys.append(y)
        deltas.append(delta)
    tape = mx.stack(deltas, axis=1).astype(mx.float32) if record else None
    return mx.stack(ys, axis=1), state, tape


def _reference_replay(tape, k, g, state):
    store = state.dtype
    k = _repeat_heads(k, tape.shape[2])
    for t in range(tape.shape[1]):
        state = _round_to(_reference_replay_step(k[:, t], g[:, t], tape[:, t], state), store)
    return state


# The kernel bodies: gated_delta_{recurrence,replay}.{metal,cuh} beside this file.
_SOURCES = {
    (impl, which): sources.read(Path(__file__).parent, f"gated_delta_{which}.{ext}")
    for impl, ext in (("metal", "metal"), ("cuda", "cuh"))
    for which in ("recurrence", "replay")
}
_INPUTS = {
    "recurrence": ["q", "k", "v", "g", "beta", "state_in"],
    "replay": ["tape", "k", "g", "state_in"],
}
_OUTPUTS = {"recurrence": ["y", "state_out", "tape"], "replay": ["state_out"]}
_built = {}


def _kernel(impl: str, which: str):
    """Build (once) the Metal or CUDA kernel ``which`` in ("recurrence", "replay")."""
    if (impl, which) not in _built:
        make = mx.fast.metal_kernel if impl == "metal" else mx.fast.cuda_kernel
        inputs = _INPUTS[which] + (["T"] if impl == "metal" else [])  # CUDA reads T from k's shape
        _built[(impl, which)] = make(
            name=f"dflash_gated_delta_{which}",
            input_names=inputs,
            output_names=_OUTPUTS[which],
            source=_SOURCES[(impl, which)],
        )
    return _built[(impl, which)]


def _kernel_recurrence(impl, q, k, v, g, beta, state, record):
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    inputs = [q, k, v, g, beta, state] + ([T] if impl == "metal" else [])
    y, state_out, tape = _kernel(impl, "recurrence")(
        inputs=inputs,
        template=[
            ("InT", q.dtype),
            ("StT", state.dtype),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
            ("Record", record),
        ],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape, (B, T, Hv, Dv) if record else (1,)],
        output_dtypes=[q.dtype, state.dtype, mx.float32],
    )
    return y, state_out, (tape if record else None)


def _kernel_replay(impl, tape, k, g, state):
    B, T, Hk, Dk = k.shape
    Hv, Dv = tape.shape[2:]
    inputs = [tape, k, g, state] + ([T] if impl == "metal" else [])
    (state_out,) = _kernel(impl, "replay")(
        inputs=inputs,
        template=[("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(Dk, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[state.shape],
        output_dtypes=[state.dtype],
    )
    return state_out


# The launcher of each kernel, by (implementation, function): the one place a GPU kernel runs.
# Tests register deliberately broken ones here to check the self-check's fallback.
LAUNCHERS = {
    ("metal", "recurrence"): _kernel_recurrence,
    ("cuda", "recurrence"): _kernel_recurrence,
    ("metal", "replay"): _kernel_replay,
    ("cuda", "replay"): _kernel_replay,
}


# ---------------------------------------------------------------------------------------------
# The self-check (selfcheck.verified): one small case per kind of call, against the reference


def _check_case(dtypes, Hk, Hv, Dk, Dv):
    """q, k, v, g, beta, state of CHECK_STEPS tokens in the given dtypes, drawn as the tests do
    (unit-norm k, gates in [0.5, 1)), from a fixed key: the same inputs in every process."""
    keys = mx.random.split(mx.random.key(selfcheck.SEED), 6)
    T = CHECK_STEPS
    q = mx.random.normal((1, T, Hk, Dk), key=keys[0]) * Dk**-0.5
    k = mx.random.normal((1, T, Hk, Dk), key=keys[1])
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((1, T, Hv, Dv), key=keys[2])
    g = mx.random.uniform(0.5, 1.0, (1, T, Hv), key=keys[3])
    beta = mx.sigmoid(mx.random.normal((1, T, Hv), key=keys[4]))
    state = mx.random.normal((1, Hv, Dv, Dk), key=keys[5]) * 0.5
    return tuple(x.astype(dt) for x, dt in zip((q, k, v, g, beta, state), dtypes))


def _recurrence_verified(impl, q, k, v, g, beta, state, record) -> bool:
    _, _, Hk, Dk = k.shape
    _, _, Hv, Dv = v.shape
    key = (
        ("q", q.dtype),
        ("k", k.dtype),
        ("v", v.dtype),
        ("g", g.dtype),
        ("beta", beta.dtype),
        ("state", state.dtype),
        ("Hk", Hk),
        ("Hv", Hv),
        ("Dk", Dk),
        ("Dv", Dv),
        ("record", bool(record)),
    )
    ok = selfcheck.known("gated_delta recurrence", impl, key)
    if ok is not None:
        return ok
    case = _check_case(tuple(dt for _, dt in key[:6]), Hk, Hv, Dk, Dv)

    def run(fn):
        y, s, tape = fn(*case, record)
        return {"y": y, "state": s, "tape": tape}

    # y is rounded to q's dtype from a state rounded to its own dtype every step; state and tape
    # (fp32) carry only the state's roundings
    tol = {
        "y": selfcheck.tolerance(q.dtype, state.dtype),
        "state": selfcheck.tolerance(state.dtype),
        "tape": selfcheck.tolerance(state.dtype),
    }
    return selfcheck.verified(
        "gated_delta recurrence",
        impl,
        key,
        run_kernel=lambda: run(lambda *a: LAUNCHERS[(impl, "recurrence")](impl, *a)),
        run_reference=lambda: run(_reference_recurrence),
        tolerance=tol,
    )


def _replay_verified(impl, tape, k, g, state) -> bool:
    _, _, Hk, Dk = k.shape
    _, _, Hv, Dv = tape.shape
    key = (
        ("tape", tape.dtype),
        ("k", k.dtype),
        ("g", g.dtype),
        ("state", state.dtype),
        ("Hk", Hk),
        ("Hv", Hv),
        ("Dk", Dk),
        ("Dv", Dv),
    )
    ok = selfcheck.known("gated_delta replay", impl, key)
    if ok is not None:
        return ok

    q_, k_, v_, g_, beta_, s0 = _check_case(
        (k.dtype, k.dtype, k.dtype, g.dtype, k.dtype, state.dtype), Hk, Hv, Dk, Dv
    )
    tape_ = _reference_recurrence(q_, k_, v_, g_, beta_, s0, True)[2].astype(tape.dtype)

    def run(fn):
        return {"state": fn(tape_, k_, g_, s0)}

    return selfcheck.verified(
        "gated_delta replay",
        impl,
        key,
        run_kernel=lambda: run(lambda *a: LAUNCHERS[(impl, "replay")](impl, *a)),
        run_reference=lambda: run(_reference_replay),
        tolerance=selfcheck.tolerance(state.dtype),
    )


# ---------------------------------------------------------------------------------------------
# The interface


def recurrence(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    record: bool = True,
    impl: Optional[str] = None,
) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
    """Run T steps of the gated delta rule from ``state``.

    q, k: [B, T, Hk, Dk] (q pre-scaled, as mlx-lm's ``normalize_qk`` leaves it); v: [B, T, Hv, Dv];
    g, beta: [B, T, Hv]; state: [B, Hv, Dv, Dk]. Returns y [B, T, Hv, Dv] in q's dtype, the
    final state in state's dtype and, with ``record``, the tape delta [B, T, Hv, Dv] in fp32.
    ``impl`` (default: ``backend()``) picks the implementation; a kernel that failed its
    self-check gives way to the reference.
    """
    impl = _pick(impl, k, v, g)
    if impl != "reference" and _recurrence_verified(impl, q, k, v, g, beta, state, record):
        return LAUNCHERS[(impl, "recurrence")](impl, q, k, v, g, beta, state, record)
    return _reference_recurrence(q, k, v, g, beta, state, record)


def replay(
    tape: mx.array, k: mx.array, g: mx.array, state: mx.array, impl: Optional[str] = None
) -> mx.array:
    """Rebuild the state after the taped steps: S_t = g_t * S_{t-1} + delta_t k_t^T, from ``state``.

    tape: [B, n, Hv, Dv] fp32; k: [B, n, Hk, Dk]; g: [B, n, Hv]; n may be 0. ``impl`` as for
    ``recurrence``.
    """
    if tape.shape[1] == 0:
        return state
    impl = _pick(impl, k, tape, g)
    if impl != "reference" and _replay_verified(impl, tape, k, g, state):
        return LAUNCHERS[(impl, "replay")](impl, tape, k, g, state)
    return _reference_replay(tape, k, g, state)

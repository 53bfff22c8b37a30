"""Kernels check themselves against the pure-MLX reference once per process, before first use.

No machine this project uses has Apple silicon: its Metal kernels (block attention, the
GatedDeltaNet recurrence and replay) have never been compiled or run, and its CUDA kernels were
run on one kind of GPU. So before a kernel serves its first call of a given kind, the
caller runs it on a small seeded random case and compares it with the reference on the same
inputs; the rule is here, in one place:

    verified(name, backend, key, run_kernel, run_reference, tolerance) -> bool

``key`` names what the call needs from the kernel: dtypes and compile-time shapes, mask and
tape flags, as (label, value) pairs. The verdict is kept per (name, backend, key) for the
process. If the kernel raises (a Metal or NVRTC compile error surfaces when the result is
evaluated) or an output differs from the reference's by more than ``tolerance`` times the
reference's largest entry (NaN fails), one RuntimeWarning names the kernel, the backend, the
key and the error or the largest difference, and says that the pure-MLX reference runs instead;
every later call with that key goes straight to the reference, without another check or warning.

DFLASH_BATCH_KERNEL_CHECK=0 skips the check (kernels run unchecked); unset or 1 checks.
``unchecked()`` skips it inside a block, for code that compares the raw kernels itself.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple, Union

import mlx.core as mx

from .... import environment

ENV = "DFLASH_BATCH_KERNEL_CHECK"
SEED = 20240607  # every check case is drawn from this key: the same inputs in every process

# Tolerance per dtype that a result was rounded to: max |kernel - reference| <= tol * max |reference|,
# per output. The check is there to catch broken kernels (a wrong index, mask or reduction, a
# miscompile), whose errors are of the order of the outputs themselves; the tolerances only have
# to clear honest rounding differences, with a wide margin, and stay far below such faults.
# - fp32: kernel and reference differ in summation order (attention: about 1e-6 in the CPU tests,
#   less on a GPU, as the recurrence) and in exp2, which on Metal may be a fast-math
#   approximation (a few ulp): 1e-4, a margin of 100x or more.
# - fp16: both sides round the same fp32 value once, so they differ by at most one ulp,
#   2^-10 |x| <= 1e-3 of the largest entry: 4e-3.
# - bf16: one ulp is up to 2^-7 |x| (8-bit significand), 7.8e-3 of the largest entry: 2e-2. It also
#   covers a bf16 recurrent state, rounded after every step (under 1e-3 at T = 16).
TOLERANCE = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 2e-2}

Outputs = Mapping[str, Optional[mx.array]]
_verdicts: Dict[tuple, bool] = {}
_skip = 0


def tolerance(*dtypes) -> float:
    """The loosest TOLERANCE among the dtypes a result was rounded to (fp32 for others)."""
    return max(TOLERANCE.get(d, TOLERANCE[mx.float32]) for d in dtypes)


def enabled() -> bool:
    """Whether kernels are checked: DFLASH_BATCH_KERNEL_CHECK unset or 1, outside ``unchecked()``."""
    return environment.get(ENV) != "0" and _skip == 0


@contextmanager
def unchecked() -> Iterator[None]:
    """Run kernels without the self-check (and without recording verdicts) inside this block."""
    global _skip
    _skip += 1
    try:
        yield
    finally:
        _skip -= 1


def verdicts() -> Dict[tuple, bool]:
    """The verdicts so far: (name, backend, *key) -> passed."""
    return dict(_verdicts)


def reset() -> None:
    """Forget every verdict (tests)."""
    _verdicts.clear()


def known(name: str, backend: str, key: Tuple[Tuple[str, object], ...]) -> Optional[bool]:
    """The cached verdict for this key; True when checks are off; None: ``verified`` must check.
    The fast path of every kernel call (a dictionary look-up)."""
    verdict = _verdicts.get((name, backend) + key)
    if verdict is None and not enabled():
        return True
    return verdict


def verified(
    name: str,
    backend: str,
    key: Tuple[Tuple[str, object], ...],
    run_kernel: Callable[[], Outputs],
    run_reference: Callable[[], Outputs],
    tolerance: Union[float, Mapping[str, float]],
) -> bool:
    """Whether the kernel may serve calls of this key: checked on the first call, then cached.

    ``run_kernel`` and ``run_reference`` take no arguments, run the kernel and the reference on
    the same seeded case and return their outputs by name (None where an output is absent);
    ``tolerance`` is one relative tolerance or one per output name.
    """
    key = tuple(key)
    verdict = known(name, backend, key)
    if verdict is not None:
        return verdict
    problem = _problem(run_kernel, run_reference, tolerance)
    full = (name, backend) + key
    _verdicts[full] = problem is None
    if problem is not None:
        warnings.warn(
            f"dflash_batch: the {backend} kernel {name!r} ({_describe(key)}) failed its self-check "
            f"against the pure-MLX reference: {problem}. The pure-MLX reference (slower) runs instead "
            f"for such calls for the rest of this process. {ENV}=0 skips the check.",
            RuntimeWarning,
            stacklevel=3,
        )
    return _verdicts[full]


def _problem(run_kernel, run_reference, tolerance) -> Optional[str]:
    """What is wrong with the kernel on the check case, or None."""
    try:
        got = dict(run_kernel())
        mx.eval([x for x in got.values() if x is not None])
    except Exception as e:  # noqa: BLE001  (compile and launch errors surface here)
        text = " ".join(str(e).split()).rstrip(".")
        return f"it raised {type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"
    want = dict(run_reference())
    mx.eval([x for x in want.values() if x is not None])
    if set(got) != set(want):
        return f"it returned outputs {sorted(got)}, the reference {sorted(want)}"
    for out, b in want.items():
        a = got[out]
        if a is None or b is None:
            if a is not b:
                return f"output {out!r} is {'missing' if a is None else 'present'}, unlike the reference's"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {out!r} is {_name(a.dtype)} {tuple(a.shape)}, the reference's {_name(b.dtype)} {tuple(b.shape)}"
        tol = tolerance[out] if isinstance(tolerance, Mapping) else tolerance
        a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
        diff = mx.abs(a32 - b32).max().item()
        scale = mx.abs(b32).max().item()
        if not diff <= tol * scale:  # NaN fails here too
            return (
                f"max difference {diff:.3g} in {out!r}, above the tolerance {tol:g} x max |reference| "
                f"{scale:.3g}"
            )
    return None


def _name(value) -> str:
    return str(value).rsplit(".", 1)[-1] if isinstance(value, mx.Dtype) else str(value)


def _describe(key) -> str:
    return ", ".join(f"{label}={_name(value)}" for label, value in key if value is not None)


__all__ = [
    "ENV",
    "TOLERANCE",
    "enabled",
    "known",
    "reset",
    "tolerance",
    "unchecked",
    "verdicts",
    "verified",
]

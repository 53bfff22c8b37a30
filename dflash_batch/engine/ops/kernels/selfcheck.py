"""Kernels check themselves against the pure-MLX reference before first use: once per process,
and once per machine for a GPU kernel that passes.

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

A GPU kernel's pass is also kept on disk, so that a machine checks a kernel once, not once per
process: MLX compiles a custom kernel's source in every process (NVRTC, Metal), and a check
compiles configurations that only the check uses, then runs the reference. A later process on
the same machine trusts a kept pass without running the kernel or the reference. The file is
``<model cache>/kernel-checks/<hash of the key>.json`` (``paths.kernel_checks_dir``) and holds
its key, which names all a verdict depends on: the kernel, backend and check key; a hash of the
sources in this folder (the launchers included: they hold the compile-time configurations);
MLX's version and the installed versions of the wheels that carry its GPU back-ends and NVRTC
(``COMPILER_WHEELS``: the compilers); the device as ``device.hardware`` describes it. A file
whose key differs, or that cannot be read, is ignored: the kernel is checked again and a pass
replaces it. A failure is never kept: a failing kernel is checked, and warned about, in every
process. The native CPU ops are not kept: they are built once per machine by the host's C++
compiler, which the key cannot name, and their check costs next to nothing. No setting forces
a check: delete the folder (a kept pass only stands for the same source, compilers and device).

DFLASH_BATCH_KERNEL_CHECK=0 skips the check (kernels run unchecked, nothing is read or kept);
unset or 1 checks. ``unchecked()`` skips it inside a block, for code that compares the raw
kernels itself.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Set, Tuple, Union

import mlx.core as mx

from .... import environment, paths
from ....files import keyed_path, write_atomic
from .. import device

ENV = "DFLASH_BATCH_KERNEL_CHECK"
SEED = 20240607  # every check case is drawn from this key: the same inputs in every process
FORMAT = 1  # bump when a kept verdict's fields change: older files then match no key
KEPT_BACKENDS = ("cuda", "metal")  # whose passes are kept on disk (module doc)
FOLDER = Path(__file__).parent  # the kernels' sources, hashed into a kept verdict's key
SOURCE_SUFFIXES = (".py", ".inc", ".cuh", ".metal", ".cpp", ".h")
COMPILER_WHEELS = ("mlx-cuda", "mlx-metal", "nvidia-cuda-nvrtc")  # name prefixes

log = logging.getLogger("dflash_batch.engine")

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
_read: Set[tuple] = set()  # the keys whose kept verdict was looked for
_machine: Optional[Dict[str, Any]] = None  # sources, compilers and device: once per process
_unwritable = False  # warned that the folder cannot be written
_counts = {"checked": 0, "kept": 0}  # checks run; passes read from disk instead
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
    """Forget this process's verdicts, as a new process starts (tests): kept ones are read again."""
    global _machine, _unwritable
    _verdicts.clear()
    _read.clear()
    _machine, _unwritable = None, False
    _counts.update(checked=0, kept=0)


def counters() -> Dict[str, int]:
    """This process's checks: "checked" (run), "kept" (a kept pass trusted instead)."""
    return dict(_counts)


def known(name: str, backend: str, key: Tuple[Tuple[str, object], ...]) -> Optional[bool]:
    """The cached verdict for this key; True when checks are off; None: ``verified`` must check.
    The fast path of every kernel call (a dictionary look-up); a key's first call also looks for
    a pass kept on disk."""
    full = (name, backend) + key
    verdict = _verdicts.get(full)
    if verdict is None:
        if not enabled():
            return True
        if full not in _read:
            _read.add(full)
            if backend in KEPT_BACKENDS and _kept(stored_key(name, backend, key)):
                _verdicts[full] = verdict = True
                _counts["kept"] += 1
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
    _counts["checked"] += 1
    full = (name, backend) + key
    _verdicts[full] = problem is None
    if problem is None and backend in KEPT_BACKENDS:
        _keep(stored_key(name, backend, key))
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


# -- verdicts kept on disk (module doc) -------------------------------------------------------


def source_hash() -> str:
    """The kernels' sources (every source file under ``FOLDER``, by path and bytes), hashed."""
    digest = hashlib.sha256()
    for path in sorted(p for p in FOLDER.rglob("*") if p.suffix in SOURCE_SUFFIXES):
        data = path.read_bytes()
        digest.update(f"{path.relative_to(FOLDER).as_posix()}:{len(data)}\n".encode())
        digest.update(data)
    return digest.hexdigest()[:32]


def compilers() -> Dict[str, str]:
    """The installed wheels that carry MLX's GPU back-ends and NVRTC, by name: their version.
    They can change while MLX's own version stays."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(COMPILER_WHEELS):
            found[name] = dist.version
    return dict(sorted(found.items()))


def machine() -> Dict[str, Any]:
    """What every kept verdict of this process depends on beyond its kernel: found once."""
    global _machine
    if _machine is None:
        _machine = {
            "sources": source_hash(),
            "mlx": mx.__version__,
            "compilers": compilers(),
            "device": device.hardware(),
        }
    return _machine


def stored_key(name: str, backend: str, key: Tuple[Tuple[str, object], ...]) -> Dict[str, Any]:
    """A kept verdict's key, as JSON reads it back (lists, plain values)."""
    check = [[label, _plain(value)] for label, value in key]
    return {"format": FORMAT, "kernel": name, "backend": backend, "check": check, **machine()}


def path_of(stored: Dict[str, Any]) -> Path:
    return keyed_path(paths.kernel_checks_dir(), stored)


def _kept(stored: Dict[str, Any]) -> bool:
    """Whether a pass is kept under this key; a file that cannot be read or names another key
    is ignored (the kernel is checked again, and a pass replaces the file)."""
    path = path_of(stored)
    try:
        kept = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as e:
        log.info("ignoring the kernel verdict in %s (%s): checking again", path, e)
        return False
    if not isinstance(kept, dict) or kept.get("key") != stored or kept.get("passed") is not True:
        log.info("ignoring the kernel verdict in %s (another key): checking again", path)
        return False
    return True


def _keep(stored: Dict[str, Any]) -> None:
    """Keep a pass; a folder that cannot be written warns once per process (kernels are then
    checked in every process, as without the folder)."""
    global _unwritable
    path = path_of(stored)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"key": stored, "passed": True}, sort_keys=True, indent=1))
    except OSError as e:
        if not _unwritable:
            _unwritable = True
            warnings.warn(
                f"dflash_batch: kernel self-check passes not kept in {path.parent}: {e}; "
                f"kernels are checked again in every process",
                stacklevel=4,
            )


def _plain(value) -> object:
    """A check key's value as JSON keeps it: dtypes by name, other values as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _name(value)


def _name(value) -> str:
    return str(value).rsplit(".", 1)[-1] if isinstance(value, mx.Dtype) else str(value)


def _describe(key) -> str:
    return ", ".join(f"{label}={_name(value)}" for label, value in key if value is not None)


__all__ = [
    "ENV",
    "FOLDER",
    "KEPT_BACKENDS",
    "TOLERANCE",
    "compilers",
    "counters",
    "enabled",
    "known",
    "machine",
    "path_of",
    "reset",
    "source_hash",
    "stored_key",
    "tolerance",
    "unchecked",
    "verdicts",
    "verified",
]

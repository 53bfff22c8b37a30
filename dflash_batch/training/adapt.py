"""``dflash-batch adapt JOB``: a drafter that learns from the job it serves.

A job's finished rows are the target's own answers to the job's own prompts, in its chat
template: what self-distillation trains on. Adapting warm-starts from the drafter the job drafts
with now, trains on the finished rows but a held-out slice (chosen by prompt, so no held-out
prompt is trained on) within a time budget, and keeps the result only if its held-out
acceptance (``tau_follow``: the acceptance of the blocks decoding would anchor next, trainer.py)
beats the current drafter's. A kept one becomes the job's next revision (runner/drafters.py), in
the drafter's own format with its training record, and workers draft with it from their next
batch on. Output never changes: greedy DFlash is exact with any drafter.

The data goes through the trainer's own layout (trainer.py) in ``drafters/.work/``: prompts.jsonl
with the prompt ids, meta.json, and an answers store; the folder is wiped at the start of every
attempt and after it, so a killed attempt leaves nothing that is read again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import AdaptRefused
from ..files import write_folder_atomic
from ..runner import drafters
from ..runner.store import key_of
from . import data
from .store import AnswerStore, prompt_key

ROW_COLUMNS = ["id", "sample_index", "status", "prompt_token_ids", "token_ids", "stop_reason"]
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class AdaptConfig:
    time_budget: float = 300.0  # seconds of training
    steps: int = 0  # 0: as many as the time budget allows
    min_rows: int = 64  # fewer finished rows (with their token ids): too small to adapt
    held_out: float = 0.1  # share of the prompts held out to judge the result
    min_gain: float = 0.0  # kept only if held-out acceptance > before * (1 + min_gain)
    batch_size: int = 16
    anchors: int = 16
    lr: float = 3e-4
    warmup: int = 10
    max_len: int = 448
    seed: int = 0


def adapt_job(
    record,
    trigger: str = "cli",
    clock: Optional[Callable[[], float]] = None,
    log: Callable[[str], None] = lambda _: None,
    after_rows: Optional[int] = None,
    **options,
) -> Dict[str, Any]:
    """Adapt ``record``'s drafter once (the caller holds ``drafters.adapt_lock``); returns the
    attempt as recorded in the job's drafter history. Raises ``AdaptRefused`` for a job too small
    or without a drafter. ``clock``: the time budget's clock (tests give their own)."""
    # after_rows: the spec's trigger
    cfg = AdaptConfig(**{k: v for k, v in options.items() if v is not None})
    if not cfg.steps and not cfg.time_budget:
        raise AdaptRefused("give a time budget or a number of steps to adapt for")
    rows = finished_rows(record)
    if len(rows) < cfg.min_rows:
        raise AdaptRefused(f"job {record.id} has {len(rows)} finished rows with their token ids; adapting "
                           f"its drafter needs at least {cfg.min_rows} (min_rows)")  # fmt: skip
    current, source = current_drafter(record)
    work = drafters.folder(record) / drafters.WORK
    shutil.rmtree(work, ignore_errors=True)
    try:
        return _adapt(record, rows, current, source, work, cfg, trigger, clock, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _adapt(
    record, rows, current, source: Path, work: Path, cfg: AdaptConfig, trigger, clock, log
) -> Dict[str, Any]:
    from .trainer import Trainer

    started = time.time()
    train_cfg, counts = training_config(record, rows, source, work, cfg)
    trainer = Trainer(train_cfg, log)
    if clock is not None:
        trainer.clock = clock
    trainer.setup()
    if not trainer.eval_samples:
        raise AdaptRefused(
            f"job {record.id}: no held-out row long enough to judge an adapted drafter"
        )
    before = trainer.evaluate()
    exported = trainer.run(resume=False)
    after = trainer.evaluate()
    entry = {
        "revision": None, "trigger": trigger, "from": current, "rows": len(rows), **counts,
        "steps": trainer.step, "train_s": round(trainer.elapsed, 3), "adapt_s": round(time.time() - started, 3),
        "held_out_before": before["tau_follow"], "held_out_after": after["tau_follow"],
        "eval_before": before, "eval_after": after,
    }  # fmt: skip
    if not after["tau_follow"] > before["tau_follow"] * (1 + cfg.min_gain):
        log(
            f"held-out acceptance {before['tau_follow']:.3f} -> {after['tau_follow']:.3f}: the current drafter stays"
        )
        return drafters.record_attempt(record, dict(entry, outcome="rejected"))
    entry["revision"] = name = drafters.next_name(record)
    training = dict(
        entry, config=asdict(cfg), source=str(source), train_config=_plain(asdict(train_cfg))
    )
    folder = write_revision(drafters.folder(record) / name, exported, source, training)
    try:
        from ..engine.models.loading import load_drafter

        load_drafter(folder)
    except Exception as e:  # never put in force what does not load
        shutil.rmtree(folder, ignore_errors=True)
        return drafters.record_attempt(
            record, dict(entry, outcome="refused", refused=f"{type(e).__name__}: {e}")
        )
    log(
        f"held-out acceptance {before['tau_follow']:.3f} -> {after['tau_follow']:.3f}: {name} in force"
    )
    return drafters.record_attempt(record, dict(entry, outcome="adopted"), adopt=True)


def finished_rows(record) -> List[Dict[str, Any]]:
    """The job's ok rows that carry their token ids (committed and journaled), once per key."""
    store = record.store()
    ids = set(record.ids())
    found = store.read(ROW_COLUMNS).to_pylist() + store.journal_rows()
    out, seen = [], set()
    for r in found:
        if (
            r.get("status") != "ok"
            or r["id"] not in ids
            or not r.get("prompt_token_ids")
            or not r.get("token_ids")
        ):
            continue
        if key_of(r) not in seen:
            seen.add(key_of(r))
            out.append(r)
    return out


def current_drafter(record) -> Tuple[Optional[str], Path]:
    """(revision in force or None, its folder): the job's adapted drafter, else its own."""
    name, folder = drafters.in_force(record)
    if name is not None:
        return name, folder
    spec = record.spec
    from ..engine.models import loading, registry

    draft, revision = spec.draft, spec.draft_revision
    if draft == "auto":
        found = (
            registry.default_pair()[1]
            if spec.target is None
            else registry.auto_drafter(spec.target)
        )
        draft, revision = (found, None) if isinstance(found, str) else (found or (None, None))
    if draft is None:
        raise AdaptRefused(f"job {record.id} decodes without a drafter: there is none to adapt")
    return None, loading.resolve_model_path(draft, revision, loading.DRAFTER_PATTERNS)


def split_prompts(keys: List[int], share: float) -> set:
    """The held-out prompt keys: a fixed share, by a hash of the key (the same rows every time)."""
    order = sorted(
        set(keys), key=lambda k: hashlib.blake2b(k.to_bytes(8, "little"), digest_size=8).digest()
    )
    return set(order[: max(1, round(len(order) * share))])


def training_config(record, rows, source: Path, work: Path, cfg: AdaptConfig):
    """Write the rows in the trainer's data layout under ``work`` and the ``TrainConfig`` that
    continues ``source`` on them; (config, counts of prompts and rows per split)."""
    from ..engine.models.drafter import ModelArgs
    from .trainer import TrainConfig, load_tokenizer_for

    config = json.loads((source / "config.json").read_text())
    quant = config.pop("quantization", None)
    args = ModelArgs.from_config(config)
    folder = work / "data"
    meta = tokenizer_meta(load_tokenizer_for(record.spec.target), args.mask_token_id)
    keys = [prompt_key(r["prompt_token_ids"]) for r in rows]
    held = split_prompts(keys, cfg.held_out)
    prompts, answers = {}, AnswerStore(folder / "answers", meta["vocab_size"])
    with answers.open_writer() as writer:
        for key, r in zip(keys, rows):
            prompts.setdefault(key, {"id": str(key), "kind": "job", "split": "eval" if key in held else "train",
                                     "key": key, "prompt": list(r["prompt_token_ids"])})  # fmt: skip
            writer.append(
                key, r.get("sample_index") or 0, r["token_ids"], r.get("stop_reason") == "eos", 0.0
            )
    data.save_samples(folder / "prompts.jsonl", prompts.values())
    (folder / "meta.json").write_text(json.dumps(meta))
    longest = max(len(r["prompt_token_ids"]) + len(r["token_ids"]) + 1 for r in rows)
    dtype = config.get("torch_dtype") if config.get("torch_dtype") in EXPORT_DTYPES else "float32"
    train_cfg = TrainConfig(
        out=str(work), target=record.spec.target, data=str(folder), train_only=True, init=str(source),
        drafter_config=config, layers=args.num_hidden_layers, block_size=args.block_size, taps=list(args.target_layer_ids),
        samples=max(r.get("sample_index") or 0 for r in rows), steps=cfg.steps, time_budget=cfg.time_budget or None,
        batch_size=cfg.batch_size, anchors=cfg.anchors, lr=cfg.lr, warmup=cfg.warmup, seed=cfg.seed,
        max_len=min(cfg.max_len, -(-longest // 32) * 32), eval_samples=len(rows), eval_every=10**9,
        checkpoint_every=10**9, log_every=10**9, keep_checkpoints=1, draft_vocab=0, export_dtype=dtype,
        quantize_bits=(quant or {}).get("bits"),
    )  # fmt: skip
    counts = {"held_out_prompts": len(held), "train_prompts": len(prompts) - len(held),
              "held_out_rows": sum(k in held for k in keys)}  # fmt: skip
    return train_cfg, counts


def tokenizer_meta(tokenizer, mask_token_id: int) -> Dict[str, Any]:
    """The trainer's meta.json fields for a job's rows: EOS ids, the label of an answer that
    ended on EOS (the template's end of turn where it is one, as trainer.prepare_prompts)."""
    from .trainer import chat_pieces

    eos = sorted(int(e) for e in tokenizer.eos_token_ids)
    try:
        suffix = chat_pieces(tokenizer)["turn_suffix"]
    except Exception:  # no chat template: the first EOS ends answers
        suffix = []
    vocab = int(len(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else 1 << 32)
    return {"eos_token_ids": eos, "answer_eos_id": suffix[0] if suffix and suffix[0] in eos else eos[0],
            "mask_token_id": int(mask_token_id), "vocab_size": vocab}  # fmt: skip


def write_revision(folder: Path, exported: Path, source: Path, training: Dict[str, Any]) -> Path:
    """The revision folder, whole or not at all: the exported drafter, the source's draft
    vocabulary (the adapted drafter drafts from the same tokens), the training record."""

    def write(tmp: Path) -> None:
        for f in exported.iterdir():
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
        vocab = source / "draft_vocab.json"
        if vocab.exists():
            shutil.copyfile(vocab, tmp / vocab.name)
        (tmp / drafters.TRAINING_RECORD).write_text(json.dumps(training, indent=2, default=str))

    return write_folder_atomic(folder, write)


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))

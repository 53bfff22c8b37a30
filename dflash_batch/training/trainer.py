"""Training a DFlash drafter by self-distillation: data, loop, checkpoints, resume, export.

Layout of the output folder::

    data/prompts.jsonl      the prompts' id, kind, source, split ("train" / "eval") and key; meta.json
    data/prompts/           their chat-templated token ids (store.py, keyed by ``key``)
    data/turns/             user turns the target wrote itself (store.py), when self_prompts
    data/answers/           the target's answers, token ids (store.py): greedy and sampled
    data/eval.jsonl         the held-out prompts with their greedy answers (for benchmarks)
    checkpoints/step-N/     drafter + optimizer state + state.json (the last two are kept)
    drafter/                the exported drafter (z-lab format: config.json + model.safetensors)
    train.log.jsonl         one JSON object per logged step / evaluation
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..engine.models import drafter as drafter_model
from ..engine.models.target import Target
from ..files import write_folder_atomic
from . import corpus, data, export, objective, prompts
from . import generate as gen
from .store import AnswerStore, prompt_key


@dataclass
class TrainConfig:
    out: str
    target: Optional[str] = None  # None: the embedded default target (SmolLM2-135M-Instruct GGUF)
    # data
    num_prompts: int = 4000
    eval_percent: int = 3
    max_answer_tokens: int = 256
    gen_batch: int = 128
    prompt_seed: int = 0
    corpus: str = "templates"  # "offline": corpus.py (stdlib passages and code, templates)
    data: Optional[str] = None  # data folder (default OUT/data); several runs may share one
    samples: int = 0  # sampled answers per prompt, besides the greedy one
    sample_temperature: float = 0.7
    self_prompts: int = 0  # prompts from user turns the target writes itself
    self_oversample: float = 1.5  # turns sampled per self prompt wanted (filters drop some)
    self_temperature: float = 1.0
    self_max_tokens: int = 96
    gen_time_budget: Optional[float] = None  # seconds for generation in one call (it resumes)
    gen_drafter: Optional[str] = None  # "default", a drafter folder, or None: plain AR
    max_answers: int = 0  # training answers used, at most (0: all)
    eval_samples: int = 64  # held-out greedy answers per evaluation
    train_only: bool = False  # train on the stored answers; generate nothing
    # drafter
    layers: int = 4
    num_taps: int = 5
    taps: Optional[List[int]] = None
    block_size: int = 16
    mask_token_id: Optional[int] = None
    intermediate_size: Optional[int] = None
    init: Optional[str] = None  # start from an exported drafter folder ("default": the shipped one)
    # optimisation
    steps: int = 0  # 0: as many as ``time_budget`` allows
    time_budget: Optional[float] = None  # seconds for the training loop
    batch_size: int = 16
    anchors: int = 32
    follow_anchors: float = 0.0  # share of a sequence's anchors placed where decoding would go next
    distill: float = 0.0  # share of the loss that is cross-entropy to the target's distribution
    max_len: int = 448
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 7.0
    dtype: str = "float32"  # target compute dtype
    seed: int = 0
    # bookkeeping
    checkpoint_every: int = 500
    eval_every: int = 250
    log_every: int = 25
    keep_checkpoints: int = 2
    quantize_bits: Optional[int] = 8
    # export a draft vocabulary of this many tokens (0: the whole vocabulary)
    draft_vocab: int = 16384
    export_dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict)
    # a drafter config to train as it is (its shape, taps and rope), rather than one made from the
    # fields above: training/adapt.py continues a job's drafter in its own format
    drafter_config: Optional[dict] = None


# -- target ----------------------------------------------------------------------------------
def load_target_model(target: Optional[str], dtype: str):
    """(model, config) without a tokenizer: a GGUF file, an MLX folder, or the default GGUF."""
    from ..engine.models import gguf

    if target is None:
        from ..engine.models.default_model import gguf_path

        target = str(gguf_path())
    mx_dtype = getattr(mx, dtype)
    if str(target).endswith(".gguf"):
        weights, meta = gguf.read_gguf(target)
        config = gguf.llama_config(meta, weights)
        return gguf.build_model(config, weights, mx_dtype), config
    from mlx_lm.utils import load_model

    from ..engine.models.loading import resolve_model_path

    model, config = load_model(resolve_model_path(target))
    model.set_dtype(mx_dtype)
    mx.eval(model.parameters())
    return model, config


def load_tokenizer_for(target: Optional[str]):
    from ..engine.models import gguf

    if target is None:
        from ..engine.models.default_model import gguf_path

        target = str(gguf_path())
    if str(target).endswith(".gguf"):
        meta = mx.load(str(target), return_metadata=True)[1]
        return gguf.load_gguf_tokenizer(
            meta, int(gguf.scalar(meta.get("tokenizer.ggml.eos_token_id", 2)))
        )
    from mlx_lm.utils import load_config, load_tokenizer

    from ..engine.models.loading import resolve_model_path

    folder = resolve_model_path(target)
    return load_tokenizer(folder, eos_token_ids=load_config(folder).get("eos_token_id"))


def tapped_hidden(target: Target, tokens: mx.array, final: bool = False):
    """Concatenated tap outputs [N, T, taps*H] of a causal forward (no cache, no LM head); with
    ``final``, also the backbone's output [N, T, H] (every layer, then the final norm), which the
    LM head turns into the target's logits."""
    h = target.embed(tokens)
    last = target.num_layers - 1 if final else max(target.tap_ids)
    for layer in target.layers[: last + 1]:
        # a hybrid's recurrent layers take no attention mask (sequences are padded on the right,
        # which no earlier position sees)
        h = layer(h, None if getattr(layer, "is_linear", False) else "causal", cache=None)
    hidden = mx.concatenate(target._store, axis=-1)
    target._store[:] = [None] * len(target.tap_ids)
    return (hidden, target._inner.norm(h)) if final else hidden


def pick_mask_token(tokenizer) -> int:
    """A special token that the chat template and ordinary text never produce: the highest
    added/special id other than BOS, EOS, PAD and UNK (and the template's own tokens)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    reserved = set(tokenizer.eos_token_ids) | {
        getattr(hf, n, None) for n in ("bos_token_id", "pad_token_id", "unk_token_id")
    }
    sample = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ],
        add_generation_prompt=True,
        tokenize=True,
    )
    reserved |= set(sample)
    candidates = sorted(
        set(hf.all_special_ids) | set(getattr(hf, "added_tokens_decoder", {}) or {})
    )
    free = [i for i in candidates if i not in reserved]
    if not free:
        raise ValueError(
            "the tokenizer has no unused special token to serve as MASK; pass --mask-token-id"
        )
    return free[-1]


# -- data stage -------------------------------------------------------------------------------
def data_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.data) if cfg.data else Path(cfg.out) / "data"


def chat_pieces(tokenizer) -> dict:
    """The chat template around one user turn, as ids: ``user_header`` (everything before the
    user's text, with the template's default system turn), ``turn_suffix`` (end of turn and the
    assistant header), and the ids no ordinary text contains (``special_ids``)."""
    mark = "XQZ-TURN-XQZ"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": mark}], add_generation_prompt=True, tokenize=False
    )
    before, after = text.split(mark)
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    special = set(hf.all_special_ids) | set(getattr(hf, "added_tokens_decoder", {}) or {})
    return {
        "user_header": [int(t) for t in tokenizer.encode(before, add_special_tokens=False)],
        "turn_suffix": [int(t) for t in tokenizer.encode(after, add_special_tokens=False)],
        "special_ids": sorted(int(t) for t in special),
    }


def build_prompt_set(cfg: TrainConfig) -> List[dict]:
    """Prompts with ``source`` and ``split``: the offline corpus, or the built-in templates."""
    if cfg.corpus == "offline":
        return corpus.build_corpus(cfg.num_prompts, cfg.prompt_seed, cfg.eval_percent)
    if cfg.corpus != "templates":
        raise ValueError(f"corpus must be 'offline' or 'templates', not {cfg.corpus!r}")
    built = prompts.build_prompts(cfg.num_prompts, cfg.prompt_seed)
    train, held = prompts.split_prompts(built, cfg.eval_percent)
    tag = lambda p, split: dict(p, source="template:" + corpus.prompt_text(p), split=split)  # noqa: E731
    return [tag(p, "train") for p in train] + [tag(p, "eval") for p in held]


def prepare_prompts(cfg: TrainConfig, log: Callable[[str], None]) -> None:
    """Encode the prompt set (needs the tokenizer) into data/prompts.jsonl + data/meta.json."""
    folder = data_dir(cfg)
    if (folder / "prompts.jsonl").exists() and (folder / "meta.json").exists():
        return
    tokenizer = load_tokenizer_for(cfg.target)
    built = build_prompt_set(cfg)
    encoded = []
    for p, enc in zip(built, data.encode_prompts(tokenizer, built)):
        encoded.append(
            dict(enc, source=p["source"], split=p["split"], key=prompt_key(enc["prompt"]))
        )
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else pick_mask_token(tokenizer)
    chat = chat_pieces(tokenizer)
    eos = sorted(int(e) for e in tokenizer.eos_token_ids)
    turn_end = chat["turn_suffix"][0] if chat["turn_suffix"] else eos[0]
    meta = {
        "eos_token_ids": eos,
        # The label that ends an answer stopped by EOS: the template's end of turn when it is an EOS.
        "answer_eos_id": turn_end if turn_end in eos else eos[0],
        "mask_token_id": int(mask),
        "mask_token": tokenizer.convert_ids_to_tokens(int(mask))
        if hasattr(tokenizer, "convert_ids_to_tokens")
        else None,
        "vocab_size": int(
            len(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else 1 << 32
        ),
        "chat": chat,
        "corpus": dict(corpus.describe(), kind=cfg.corpus),
        "num_prompts": len(encoded),
        "train_prompts": sum(p["split"] == "train" for p in encoded),
        "eval_prompts": sum(p["split"] == "eval" for p in encoded),
        "eval_percent": cfg.eval_percent,
        "prompt_seed": cfg.prompt_seed,
    }
    # Ids go to a token store (2 bytes a token for a vocabulary up to 65536), the rest to JSON lines.
    ids = AnswerStore(folder / "prompts", meta["vocab_size"])
    with ids.open_writer() as w:
        for p in encoded:
            w.append(p["key"], 0, p["prompt"], False, 0.0)
    data.save_samples(
        folder / "prompts.jsonl", [{k: v for k, v in p.items() if k != "prompt"} for p in encoded]
    )
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))
    log(
        f"encoded {meta['train_prompts']} training and {meta['eval_prompts']} held-out prompts; mask token {mask} ({meta['mask_token']})"
    )


def prompt_order(p: dict) -> tuple:
    """Held-out first (the encoded before the self-written), then by key."""
    held = p["split"] == "eval"
    return (not held, held and p["kind"] == "self", p["key"])


def all_prompts(cfg: TrainConfig, meta: dict) -> List[dict]:
    """The encoded prompts and the self-written ones, held-out first, then by key (a stable
    random order: the first N training prompts are a fair subset for any N). Held-out
    self-written prompts come after the encoded ones, so an evaluation of the first N held-out
    answers reads the same answers as self-written turns are added."""
    folder = data_dir(cfg)
    found = data.load_samples(folder / "prompts.jsonl")
    if found and "prompt" not in found[0]:  # the ids live in the prompts store
        ids = {r.key: r.tokens for r in AnswerStore(folder / "prompts").records()}
        found = [dict(p, prompt=ids[p["key"]]) for p in found]
    if (folder / "turns" / "store.json").exists():
        turns = AnswerStore(folder / "turns")
        made = gen.self_prompts(
            turns,
            meta["chat"],
            meta["chat"]["special_ids"],
            cfg.self_prompts or None,
            cfg.eval_percent,
        )
        taken = {p["key"] for p in found}
        found += [p for p in made if p["key"] not in taken]
    return sorted(found, key=prompt_order)


def answer_samples(cfg: TrainConfig) -> Tuple[int, List[dict], List[dict]]:
    """(answers stored, training samples, held-out samples) ``{"prompt", "answer"}``; an answer
    that ended on EOS carries the EOS label last. ``max_answers`` caps the training answers
    (the first by prompt key), for data-size sweeps."""
    folder = data_dir(cfg)
    meta = json.loads((folder / "meta.json").read_text())
    if not (folder / "answers" / "store.json").exists():
        return 0, [], []
    stored = AnswerStore(folder / "answers").answers()
    train, held = [], []
    for p in all_prompts(cfg, meta):
        for k in range(1 + cfg.samples):
            r = stored.get((p["key"], k))
            if r is None:
                continue
            answer = r.tokens + (
                [meta.get("answer_eos_id", meta["eos_token_ids"][0])] if r.ended else []
            )
            sample = {
                "id": p["id"],
                "kind": p["kind"],
                "sample": k,
                "prompt": p["prompt"],
                "answer": answer,
            }
            (held if p["split"] == "eval" else train).append(sample)
    if cfg.max_answers:
        train = train[: cfg.max_answers]
    return len(stored), train, held


def generation_engine(cfg: TrainConfig, model, config: dict, eos_ids):
    """The batched engine over the target (with ``gen_drafter``: DFlash, lossless greedy)."""
    from ..engine import Engine, load_drafter

    drafter = None
    if cfg.gen_drafter:
        from ..engine.models.default_model import ensure_drafter

        path = ensure_drafter(cfg.dtype) if cfg.gen_drafter == "default" else cfg.gen_drafter
        drafter = load_drafter(path) if path else None
    return Engine(
        model, gen.IdsTokenizer(eos_ids), drafter, config=config, batch_size=cfg.gen_batch
    )


def prepare_answers(
    cfg: TrainConfig, model, log: Callable[[str], None], config: Optional[dict] = None
) -> bool:
    """Sample the self-written user turns (``self_prompts``), then store greedy and ``samples``
    sampled answers to every prompt in data/answers/, within ``gen_time_budget``; True when
    nothing is left to generate. Resumes where a previous run stopped."""
    folder = data_dir(cfg)
    meta = json.loads((folder / "meta.json").read_text())
    deadline = time.perf_counter() + cfg.gen_time_budget if cfg.gen_time_budget else None
    config = config or {}
    # the model may pad its vocabulary
    vocab = max(int(config.get("vocab_size") or 0), meta["vocab_size"])
    if cfg.self_prompts:
        chat = meta["chat"]
        # A user turn ends at the template's end of turn: an EOS while the turns are sampled.
        eos = set(meta["eos_token_ids"]) | set(chat["turn_suffix"][:1])
        engine = generation_engine(cfg, model, config, eos)
        # Oversample: filters and duplicates drop some turns.
        turns = AnswerStore(folder / "turns", vocab)
        got = gen.sample_user_turns(
            engine,
            chat,
            turns,
            int(cfg.self_prompts * cfg.self_oversample),
            cfg.self_temperature,
            cfg.self_max_tokens,
            cfg.seed,
            cfg.gen_batch,
            deadline,
            log,
        )
        if got["left"]:
            log(f"time budget: {got['left']} user turns left to sample")
            return False
    engine = generation_engine(cfg, model, config, meta["eos_token_ids"])
    todo = all_prompts(cfg, meta)
    store = AnswerStore(folder / "answers", vocab)
    got = gen.generate_to_store(
        engine,
        todo,
        store,
        range(1 + cfg.samples),
        cfg.sample_temperature,
        cfg.max_answer_tokens,
        cfg.seed,
        cfg.gen_batch,
        deadline,
        log=log,
    )
    _, _, held = answer_samples(cfg)
    # for benchmarks/default_pair.py
    data.save_samples(folder / "eval.jsonl", [s for s in held if s["sample"] == 0])
    if got["left"]:
        log(f"time budget: {got['left']} answers left to generate")
    return not got["left"]


# -- optimisation -----------------------------------------------------------------------------
def learning_rate(cfg: TrainConfig, step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def batch_indices(cfg: TrainConfig, step: int, n: int) -> np.ndarray:
    """Sample indices of a step: a fresh permutation per epoch, a function of (seed, step)."""
    per_epoch = max(1, n // cfg.batch_size)
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([cfg.seed, epoch]).permutation(n)
    idx = order[k * cfg.batch_size : (k + 1) * cfg.batch_size]
    return idx if len(idx) == cfg.batch_size else order[: cfg.batch_size]


class Trainer:
    def __init__(self, cfg: TrainConfig, log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        self.out = Path(cfg.out)
        self.log_file = self.out / "train.log.jsonl"
        # the time budget's clock (a test's own)
        self.clock: Callable[[], float] = time.perf_counter
        self.ready = False  # set up (``setup``): ``run`` does it only if not

    def record(self, entry: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    # -- set-up ---------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        prepare_prompts(cfg, self.log)
        self.model, self.target_config = load_target_model(cfg.target, cfg.dtype)
        if not cfg.train_only and not prepare_answers(
            cfg, self.model, self.log, self.target_config
        ):
            self.log(
                "training on the answers stored so far (generation stopped at its time budget)"
            )
        self.meta = json.loads((data_dir(cfg) / "meta.json").read_text())
        stored, train, held = answer_samples(cfg)
        self.train_samples = [s for s in train if len(s["answer"]) >= 2]
        # greedy acceptance
        self.eval_samples = [s for s in held if s["sample"] == 0 and len(s["answer"]) >= 2]
        if not self.train_samples:
            raise ValueError(
                f"no training answers in {data_dir(cfg) / 'answers'} ({stored} stored): generate them first"
            )
        n_layers = self.target_config["num_hidden_layers"]
        taps = cfg.taps or objective.tap_ids_for(n_layers, cfg.num_taps)
        self.drafter_config = cfg.drafter_config or export.drafter_config(
            self.target_config,
            layers=cfg.layers,
            block_size=cfg.block_size,
            mask_token_id=self.meta["mask_token_id"],
            target_layer_ids=taps,
            intermediate_size=cfg.intermediate_size,
        )
        self.target = Target(self.model, taps)
        mx.random.seed(cfg.seed)
        self.drafter = drafter_model.Model(drafter_model.ModelArgs.from_config(self.drafter_config))
        # The drafter's output feeds the target's LM head: start from the target's final norm scale.
        final_norm = getattr(self.target._inner, "norm", None)
        if final_norm is not None and final_norm.weight.shape == self.drafter.norm.weight.shape:
            self.drafter.norm.weight = final_norm.weight.astype(mx.float32)
        if cfg.init:
            self.warm_start(cfg.init)
        mx.eval(self.drafter.parameters())
        self.optimizer = optim.AdamW(
            learning_rate=cfg.lr, betas=[0.9, 0.95], weight_decay=cfg.weight_decay
        )
        self.optimizer.init(self.drafter.trainable_parameters())
        self.step, self.total_steps, self.elapsed = 0, cfg.steps or None, 0.0
        self._grad = nn.value_and_grad(self.drafter, self._loss)
        self.ready = True

    # Config keys that fix the drafter's shape and meaning; a warm start must match them all.
    SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "dflash_config")  # fmt: skip

    def warm_start(self, source: str) -> None:
        """Start from an exported drafter (its quantized linears dequantized to fp32), so a longer
        run continues a shipped drafter; a checkpoint in ``out`` still wins (``resume``).

        A drafter of fewer layers grows: its layers are the first ones and each layer added after
        them starts as the identity (its attention and MLP output projections zero, so its residual
        branches add nothing), so the run starts from the source's exact drafts and trains the new
        layers from there."""
        from ..engine.models.default_model import DRAFTER_ASSET, plain_drafter_weights

        folder = DRAFTER_ASSET if source == "default" else Path(source)
        config, weights = plain_drafter_weights(folder, "float32")
        layers, mine = config.get("num_hidden_layers"), self.drafter_config.get("num_hidden_layers")
        grows = isinstance(layers, int) and isinstance(mine, int) and 0 < layers < mine
        differ = [
            k
            for k in self.SHAPE_KEYS
            if config.get(k) != self.drafter_config.get(k)
            and not (grows and k == "num_hidden_layers")
        ]
        if differ:
            raise ValueError(
                f"--init {folder}: its {', '.join(differ)} differ from this run's drafter"
            )
        self.drafter.load_weights(list(weights.items()), strict=not grows)
        for layer in self.drafter.layers[layers:] if grows else ():
            layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
            layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
        grown = (
            f", grown from {layers} to {mine} layers (the new ones the identity)" if grows else ""
        )
        self.log(f"starting from the drafter in {folder}{grown}")

    def _loss(self, emb, context, anchors, labels, weights, teacher=None):
        return objective.dflash_loss(
            self.drafter,
            self.target.lm_head,
            emb,
            context,
            anchors,
            labels,
            weights,
            teacher,
            self.cfg.distill,
        )

    # -- one step ---------------------------------------------------------------------------
    def _host(self, samples, rng, anchors: int) -> dict:
        cfg = self.cfg
        return objective.make_batch(
            samples,
            rng,
            anchors,
            cfg.block_size,
            self.meta["mask_token_id"],
            cfg.gamma,
            cfg.max_len,
            cfg.max_len,
        )

    def _blocks(self, host: dict):
        """Drafter inputs of a host batch: block embeddings, anchors, labels, weights."""
        b = objective.to_mx({k: host[k] for k in ("block", "anchors", "labels", "weights")})
        N, A, B = b["block"].shape
        emb = self.target.embed(b["block"].reshape(N, A * B)).astype(mx.float32)
        return emb, b["anchors"], b["labels"], b["weights"]

    def _at(self, host: dict, anchors: np.ndarray) -> dict:
        """``host``'s sequences with blocks at ``anchors`` instead (-1: none)."""
        cfg = self.cfg
        return objective.blocks_at(
            host["tokens"],
            host["lengths"],
            anchors,
            cfg.block_size,
            self.meta["mask_token_id"],
            cfg.gamma,
        )

    def _follow_ups(
        self, host: dict, logits: mx.array, labels: mx.array, weights: mx.array
    ) -> np.ndarray:
        """Anchors [N, A] where decoding would anchor its next block after each of ``host``'s
        (p + accepted + 1, accepted from the drafter's ``logits`` there; -1 where none)."""
        accepted = np.array(objective.accepted_drafts(logits, labels, weights))
        return objective.follow_up_anchors(
            host["anchors"], accepted, host["weights"][..., 0] > 0, host["lengths"]
        )

    def _inputs(self, samples, rng):
        """A step's inputs. With ``follow_anchors`` = f, a share f of the anchors (at most half)
        is not drawn but placed where decoding would anchor next after drawn ones, chosen at
        random: right after a draft the target overruled, a harder place than a uniform draw
        (docs/results/drafter-training.md, "Why real decoding accepts less")."""
        cfg = self.cfg
        follow = min(int(round(cfg.follow_anchors * cfg.anchors)), cfg.anchors // 2)
        host = self._host(samples, rng, cfg.anchors - follow)
        tokens = mx.array(host["tokens"])
        if cfg.distill > 0:  # the backbone's output too: the teacher's logits come from it
            context, final = tapped_hidden(self.target, tokens, final=True)
        else:
            context, final = tapped_hidden(self.target, tokens), None
        context = context.astype(mx.float32)
        if follow:
            drawn = np.where(host["weights"][..., 0] > 0, host["anchors"], -1)
            chosen = np.sort(rng.choice(drawn.shape[1], follow, replace=False))
            some = {
                k: (v[:, chosen] if k in ("anchors", "block", "labels", "weights") else v)
                for k, v in host.items()
            }
            emb, anchors, labels, weights = self._blocks(some)
            logits = objective.block_logits(
                self.drafter, self.target.lm_head, emb, context, anchors
            )
            host = self._at(
                host,
                np.concatenate([drawn, self._follow_ups(some, logits, labels, weights)], axis=1),
            )
        emb, anchors, labels, weights = self._blocks(host)
        return emb, context, anchors, labels, weights, self._teacher(final, anchors)

    def _teacher(self, final: Optional[mx.array], anchors: mx.array) -> Optional[mx.array]:
        """The target's logits [N, A, B-1, V] where it predicts each block label (``distill``)."""
        if final is None:
            return None
        pos = objective.teacher_positions(anchors, self.cfg.block_size, final.shape[1])
        N, A, K = pos.shape
        rows = mx.take_along_axis(final, pos.reshape(N, A * K, 1), axis=1)  # [N, A*K, H]
        return mx.stop_gradient(self.target.lm_head(rows).reshape(N, A, K, -1))

    def train_step(self, step: int) -> float:
        cfg = self.cfg
        idx = batch_indices(cfg, step, len(self.train_samples))
        rng = np.random.default_rng([cfg.seed, step, 1])
        emb, context, anchors, labels, weights, teacher = self._inputs(
            [self.train_samples[i] for i in idx], rng
        )
        (loss, _), grads = self._grad(emb, context, anchors, labels, weights, teacher)
        grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        self.optimizer.learning_rate = learning_rate(cfg, step, self.total_steps or cfg.warmup * 10)
        self.optimizer.update(self.drafter, grads)
        mx.eval(self.drafter.parameters(), self.optimizer.state, loss)
        return float(loss.item())

    def evaluate(self, max_samples: Optional[int] = None) -> dict:
        """Loss and teacher-forced acceptance on the held-out split (fixed uniform anchors), and
        ``tau_follow``: the acceptance of the blocks decoding would anchor next after those,
        closer to what real decoding accepts (docs/results/drafter-training.md, "Why real
        decoding accepts less")."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, 10**9])
        samples = self.eval_samples[: max_samples or cfg.eval_samples]
        totals = {"loss": 0.0, "tau": 0.0, "acc_pos1": 0.0, "tau_follow": 0.0}
        batches = 0
        for first in range(0, len(samples), cfg.batch_size):
            host = self._host(samples[first : first + cfg.batch_size], rng, cfg.anchors)
            context = tapped_hidden(self.target, mx.array(host["tokens"])).astype(mx.float32)
            emb, anchors, labels, weights = self._blocks(host)
            logits = objective.block_logits(
                self.drafter, self.target.lm_head, emb, context, anchors
            ).astype(mx.float32)
            ce = nn.losses.cross_entropy(logits, labels, reduction="none")
            totals["loss"] += float(((ce * weights).sum() / mx.maximum(weights.sum(), 1e-6)).item())
            for k, v in objective.acceptance_stats(logits, labels, weights).items():
                totals[k] += v
            emb, anchors, labels, weights = self._blocks(
                self._at(host, self._follow_ups(host, logits, labels, weights))
            )
            logits = objective.block_logits(
                self.drafter, self.target.lm_head, emb, context, anchors
            )
            totals["tau_follow"] += objective.acceptance_stats(logits, labels, weights)["tau"]
            batches += 1
        return {k: v / max(batches, 1) for k, v in totals.items()}

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self) -> Path:
        folder = self.checkpoint_dir() / f"step-{self.step:07d}"
        state = {
            "step": self.step,
            "total_steps": self.total_steps,
            "elapsed_s": self.elapsed,
            "drafter_config": self.drafter_config,
            "train_config": asdict(self.cfg),
        }

        def write(tmp: Path) -> None:
            mx.save_safetensors(
                str(tmp / "drafter.safetensors"), dict(tree_flatten(self.drafter.parameters()))
            )
            mx.save_safetensors(
                str(tmp / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state))
            )
            (tmp / "state.json").write_text(json.dumps(state, indent=2))

        write_folder_atomic(folder, write, replace=True)
        kept = sorted(
            p for p in self.checkpoint_dir().glob("step-*") if not p.name.endswith(".tmp")
        )
        for old in kept[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return folder

    def latest_checkpoint(self) -> Optional[Path]:
        found = sorted(
            p for p in self.checkpoint_dir().glob("step-*") if (p / "state.json").exists()
        )
        return found[-1] if found else None

    def resume(self, folder: Path) -> None:
        state = json.loads((folder / "state.json").read_text())
        if state["drafter_config"] != self.drafter_config:
            raise ValueError(f"checkpoint {folder} is for a different drafter configuration")
        self.drafter.load_weights(
            list(mx.load(str(folder / "drafter.safetensors")).items()), strict=True
        )
        self.optimizer.state = tree_unflatten(
            list(mx.load(str(folder / "optimizer.safetensors")).items())
        )
        mx.eval(self.drafter.parameters(), self.optimizer.state)
        self.step, self.elapsed = state["step"], state["elapsed_s"]
        self.total_steps = self.cfg.steps or state["total_steps"]  # a new --steps extends the run
        self.log(f"resumed from {folder} at step {self.step}")

    # -- the loop ---------------------------------------------------------------------------
    def run(self, resume: bool = True) -> Path:
        cfg = self.cfg
        if not self.ready:
            self.setup()
        latest = self.latest_checkpoint() if resume else None
        if latest is not None:
            self.resume(latest)
        if not cfg.steps and not cfg.time_budget:
            raise ValueError("give a step count (steps) or a time budget (time_budget)")
        n_params = sum(p.size for _, p in tree_flatten(self.drafter.parameters()))
        self.log(f"drafter: {n_params / 1e6:.2f}M parameters, taps {self.target.tap_ids}")
        self.log(
            f"training on {len(self.train_samples)} sequences, evaluating on {len(self.eval_samples)}"
        )
        session_start = self.clock()
        timed_from, timed_steps = None, 0
        losses: List[float] = []
        while self.total_steps is None or self.step < self.total_steps:
            t0 = self.clock()
            losses.append(self.train_step(self.step))
            self.step += 1
            now = self.clock()
            self.elapsed += now - t0
            # Calibrate the step count to the time budget once steps have a steady cost.
            if self.total_steps is None:
                if self.step == 5:
                    timed_from, timed_steps = now, 0
                elif timed_from is not None:
                    timed_steps += 1
                    if timed_steps == 20:
                        per_step = (now - timed_from) / timed_steps
                        left = cfg.time_budget - (now - session_start)
                        self.total_steps = self.step + max(1, int(left * 0.95 / per_step))
                        self.log(
                            f"{per_step * 1000:.0f} ms/step: training {self.total_steps} steps in the budget"
                        )
            if self.step % cfg.log_every == 0:
                entry = {
                    "step": self.step,
                    "loss": float(np.mean(losses)),
                    "lr": learning_rate(cfg, self.step - 1, self.total_steps or 1),
                    "elapsed_s": round(self.elapsed, 1),
                }
                self.record(entry)
                self.log(json.dumps(entry))
                losses = []
            if self.step % cfg.eval_every == 0:
                entry = {"step": self.step, "eval": self.evaluate()}
                self.record(entry)
                self.log(json.dumps(entry))
            if self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
            if cfg.time_budget and now - session_start > cfg.time_budget:
                self.log(f"time budget reached at step {self.step}")
                break
        self.save_checkpoint()
        final = {
            "step": self.step,
            "final_eval": self.evaluate(),
            "elapsed_s": round(self.elapsed, 1),
        }
        self.record(final)
        self.log(json.dumps(final))
        return self.export()

    def export(self) -> Path:
        cfg = self.cfg
        out = self.out / "drafter"
        export.save_drafter(
            out,
            self.drafter,
            self.drafter_config,
            dtype=cfg.export_dtype,
            quantize_bits=cfg.quantize_bits,
        )
        if cfg.draft_vocab:
            write_draft_vocab(cfg, out, self.log, self.train_samples)
        self.log(f"exported the drafter to {out}")
        return out


def write_draft_vocab(
    cfg: TrainConfig,
    folder: Path,
    log: Callable[[str], None] = print,
    samples: Optional[List[dict]] = None,
) -> Optional[Path]:
    """Write ``folder``'s draft vocabulary (engine/decode.py: ``DraftHead``): the ``draft_vocab``
    tokens the target writes most in the training answers (held-out answers never count), its
    EOS ids among them. None (and no file) when that would be the whole vocabulary."""
    meta = json.loads((data_dir(cfg) / "meta.json").read_text())
    if cfg.draft_vocab <= 0 or cfg.draft_vocab >= meta["vocab_size"]:
        return None
    if samples is None:
        _, samples, _ = answer_samples(cfg)
    if not samples:
        raise ValueError(f"no training answers in {data_dir(cfg) / 'answers'}: generate them first")
    vocab = export.draft_vocab(
        (s["answer"] for s in samples), meta["vocab_size"], cfg.draft_vocab, meta["eos_token_ids"]
    )
    path = export.save_draft_vocab(folder, vocab)
    log(
        f"draft vocabulary: {len(vocab['token_ids'])} of {meta['vocab_size']} tokens, "
        f"{vocab['coverage']:.2%} of {vocab['answer_tokens']} training answer tokens ({vocab['answers']} answers) -> {path}"
    )
    return path

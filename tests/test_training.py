"""train-drafter: the packed objective equals inference, batches, checkpoints, resume, export."""

from __future__ import annotations

import json
import shutil

from dflash_batch.engine import Engine, load_drafter
from dflash_batch.engine.models import drafter as drafter_model
from dflash_batch.engine.models import loading

import mlx.core as mx
import numpy as np
import pytest

from dflash_batch.training import cli, export, objective, prompts
from dflash_batch.training.trainer import pick_mask_token
from tests import synthetic


def test_packed_forward_equals_inference_forward():
    """Every anchor block of the packed training pass equals the engine's drafter call with a
    fresh cache holding exactly the context before the anchor."""
    target = synthetic.tiny_llama_config(layers=4)
    cfg = export.drafter_config(
        target, layers=2, block_size=8, mask_token_id=3, target_layer_ids=[1, 2]
    )
    mx.random.seed(0)
    model = drafter_model.Model(drafter_model.ModelArgs.from_config(cfg))
    H, T = target["hidden_size"], 40
    context = mx.random.normal((2, T, 2 * H))
    table = mx.random.normal((512, H))
    anchors = mx.array([[5, 17, 30], [1, 9, 33]])
    block = mx.random.randint(0, 512, (2, 3, 8))
    packed = objective.packed_forward(model, table[block.reshape(2, 24)], context, anchors).reshape(
        2, 3, 8, H
    )
    for n in range(2):
        for a in range(3):
            p = anchors[n, a].item()
            ref = model(table[block[n, a]][None], context[n : n + 1, :p], model.make_cache())[0]
            assert mx.allclose(ref, packed[n, a], atol=1e-4).item(), (n, a)


def test_batch_blocks_labels_and_weights():
    samples = [
        {"prompt": [1, 2, 3], "answer": [10, 11, 12, 13, 14, 15, 16]},
        {"prompt": [1, 2], "answer": [20, 21]},
        {"prompt": [1, 2, 3, 4], "answer": [30]},  # no usable anchor
    ]
    B, mask = 4, 99
    batch = objective.make_batch(
        samples, np.random.default_rng(0), 3, B, mask, gamma=2.0, max_len=64, pad_to=16
    )
    assert batch["tokens"].shape == (3, 16)
    decay = np.exp(-np.arange(B - 1) / 2.0)
    for i, s in enumerate(samples):
        seq = s["prompt"] + s["answer"]
        for a, p in enumerate(batch["anchors"][i]):
            w = batch["weights"][i, a]
            if i == 2:
                assert not w.any()  # weight zero: nothing to learn from this sequence
                continue
            assert len(s["prompt"]) <= p < len(seq) - 1  # anchors lie in the answer
            assert batch["block"][i, a, 0] == seq[p] and (batch["block"][i, a, 1:] == mask).all()
            for k in range(1, B):
                if p + k < len(seq):
                    assert batch["labels"][i, a, k - 1] == seq[p + k] and w[k - 1] == pytest.approx(
                        decay[k - 1]
                    )
                else:
                    assert w[k - 1] == 0


def test_attention_mask():
    m = objective.attention_mask(mx.array([[2, 4]]), context_len=5, block_size=2)[0, 0]
    expected = np.array(
        [
            # context 0..4     block rows a0 a0 a1 a1
            [1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 1, 1],
            [1, 1, 1, 1, 0, 0, 0, 1, 1],
        ],
        dtype=bool,
    )
    assert (np.array(m) == expected).all()


def test_prompt_set_and_held_out_split():
    built = prompts.build_prompts(1500, seed=0)
    assert len(built) == 1500 and {p["kind"] for p in built} == set(prompts.KINDS)
    train, held = prompts.split_prompts(built, 3)
    assert held and not {p["id"] for p in train} & {p["id"] for p in held}
    # Membership depends on the prompt text alone: a bigger set keeps the same prompts held out.
    _, held_big = prompts.split_prompts(prompts.build_prompts(3000, seed=0), 3)
    text = lambda p: "\n".join(m["content"] for m in p["messages"])  # noqa: E731
    assert {text(p) for p in held} <= {text(p) for p in held_big}
    assert not {text(p) for p in train} & {text(p) for p in held_big}


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train") / "target"
    return synthetic.save_target(folder, synthetic.tiny_llama_config(layers=6), seed=3)


def test_mask_token_is_an_unused_special(tiny_target):
    tok = loading.load_target(tiny_target)[1]
    assert pick_mask_token(tok) == tok.convert_tokens_to_ids("<|mask|>")


def test_train_checkpoint_resume_export(tiny_target, tmp_path, capsys):
    out = tmp_path / "run"
    argv = [
        "--target", str(tiny_target), "--out", str(out), "--prompts", "30", "--eval-percent", "20",
        "--max-answer-tokens", "20", "--gen-batch", "16", "--steps", "4", "--batch-size", "4", "--anchors", "4",
        "--max-len", "96", "--layers", "1", "--taps", "2", "--checkpoint-every", "2", "--eval-every", "2",
        "--log-every", "1", "--warmup", "2",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    assert "exported the drafter" in capsys.readouterr().err
    meta = json.loads((out / "data" / "meta.json").read_text())
    assert meta["eval_prompts"] > 0 and meta["train_prompts"] + meta["eval_prompts"] == 30
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step-0000002", "step-0000004"]
    first = mx.load(str(out / "checkpoints" / "step-0000004" / "drafter.safetensors"))

    # Lose the last checkpoint; the same command resumes at step 2 and reaches the same weights.
    shutil.rmtree(out / "checkpoints" / "step-0000004")
    assert cli.main(argv) == 0
    assert "resumed from" in capsys.readouterr().err
    again = mx.load(str(out / "checkpoints" / "step-0000004" / "drafter.safetensors"))
    assert first.keys() == again.keys()
    for k in first:
        assert mx.allclose(first[k], again[k], atol=1e-6).item(), k
    log = [json.loads(line) for line in (out / "train.log.jsonl").read_text().splitlines()]
    assert any("final_eval" in e for e in log) and any("eval" in e for e in log)

    # The export is a z-lab-format drafter (8-bit linears) that the engine loads and uses losslessly.
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == meta["mask_token_id"]
    assert config["quantization"] == {"group_size": 64, "bits": 8}
    drafter = load_drafter(out / "drafter")
    model, tok, cfg = loading.load_target(tiny_target)
    dflash = Engine(model, tok, drafter, config=cfg).generate("Hello there", max_tokens=24)
    model2, tok2, cfg2 = loading.load_target(tiny_target)
    plain = Engine(model2, tok2, None, config=cfg2).generate("Hello there", max_tokens=24)
    assert dflash.token_ids == plain.token_ids and dflash.stats.cycles > 0

    # --init starts a new run from the export (dequantized); a drafter of another shape is refused.
    from dflash_batch.engine.models.default_model import plain_drafter_weights

    from dflash_batch.training.trainer import TrainConfig, Trainer

    _, exported = plain_drafter_weights(out / "drafter", "float32")
    base = dict(out=str(tmp_path / "more"), target=str(tiny_target), data=str(out / "data"), train_only=True,
                steps=1, layers=1, num_taps=2, max_len=96)  # fmt: skip
    fresh = Trainer(TrainConfig(**base), log=lambda _: None)
    fresh.setup()
    warm = Trainer(TrainConfig(**base, init=str(out / "drafter")), log=lambda _: None)
    warm.setup()
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(warm.drafter.parameters()))
    assert params.keys() == exported.keys()
    assert all(mx.array_equal(params[k], exported[k]).item() for k in exported)
    assert not mx.array_equal(
        dict(tree_flatten(fresh.drafter.parameters()))["fc.weight"], exported["fc.weight"]
    ).item()
    with pytest.raises(ValueError, match="intermediate_size"):
        Trainer(
            TrainConfig(**dict(base, intermediate_size=24), init=str(out / "drafter")),
            log=lambda _: None,
        ).setup()

    # A drafter of more layers grows from it: the export's layer first, the new one the identity,
    # so the grown drafter scores the held-out answers exactly as the export does.
    grown = Trainer(
        TrainConfig(**dict(base, layers=2), init=str(out / "drafter")), log=lambda _: None
    )
    grown.setup()
    params = dict(tree_flatten(grown.drafter.parameters()))
    assert all(mx.array_equal(params[k], exported[k]).item() for k in exported)
    assert not mx.any(params["layers.1.self_attn.o_proj.weight"]).item()
    assert not mx.any(params["layers.1.mlp.down_proj.weight"]).item()
    assert mx.any(
        params["layers.1.self_attn.q_proj.weight"]
    ).item()  # the rest trains from a random start
    assert grown.evaluate() == warm.evaluate()
    two_layers = grown.export()
    with pytest.raises(ValueError, match="num_hidden_layers"):  # shrinking is refused
        Trainer(TrainConfig(**base, init=str(two_layers)), log=lambda _: None).setup()

    # More --steps than one call's --time-budget allows: one step, a checkpoint, exit status 3.
    longer = [a if a != "4" or argv[i - 1] != "--steps" else "6" for i, a in enumerate(argv)]
    assert cli.main(longer + ["--time-budget", "1e-9"]) == 3
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step-0000005"
    assert not (
        out / "drafter" / "draft_vocab.json"
    ).exists()  # 16384 by default: the whole tiny vocabulary
    assert cli.main(longer + ["--draft-vocab", "64"]) == 0

    # The export's draft vocabulary: the 64 tokens its training answers hold most, EOS among them.
    vocab = json.loads((out / "drafter" / "draft_vocab.json").read_text())
    ids = vocab["token_ids"]
    assert len(ids) == 64 and ids == sorted(set(ids)) and set(meta["eos_token_ids"]) <= set(ids)
    from dflash_batch.training.trainer import answer_samples

    _, train, held = answer_samples(TrainConfig(out=str(out), samples=0))
    counts = np.bincount(np.concatenate([s["answer"] for s in train]), minlength=meta["vocab_size"])
    eos = meta["eos_token_ids"]
    others = np.sort(np.delete(counts, eos))[::-1]
    assert (
        counts[ids].sum() == counts[eos].sum() + others[: 64 - len(eos)].sum()
    )  # no more-written token left out
    assert vocab["answers"] == len(train) and vocab["answer_tokens"] == counts.sum()
    model3, tok3, cfg3 = loading.load_target(tiny_target)
    cut = Engine(model3, tok3, load_drafter(out / "drafter"), config=cfg3)
    assert cut.draft_head is not None and len(cut.draft_head) == 64
    assert cut.generate("Hello there", max_tokens=24).token_ids == plain.token_ids

    # --write-draft-vocab adds one to a drafter folder from a run's answers, and trains nothing.
    other = shutil.copytree(out / "drafter", tmp_path / "other")
    (other / "draft_vocab.json").unlink()
    assert (
        cli.main(["--out", str(out), "--write-draft-vocab", str(other), "--draft-vocab", "32"]) == 0
    )
    assert len(json.loads((other / "draft_vocab.json").read_text())["token_ids"]) == 32
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step-0000006"
    assert cli.main(["--out", str(out), "--write-draft-vocab", str(tmp_path / "nowhere")]) == 2


def test_engine_drafts_equal_the_training_objective(
    qwen3_target, model_dir, monkeypatch, chain_drafts
):
    """End to end, training and real decoding feed the drafter the same tensors: at every cycle's
    anchor p (the newest committed token), the engine's draft logits equal ``block_logits`` of the
    training path over the committed sequence (context = ``tapped_hidden`` of a causal pass, rows
    s < p; block [x_p, MASK...] at positions p..p+B-1). Scripted proposals make the cycles accept
    0 to B-1 drafts, so anchors and context counts vary as in real decoding. A mismatch in taps,
    context rows, positions or the mask token shows here, as a drafter whose real acceptance
    falls short of its teacher-forced one (issue 15)."""
    from dflash_batch.engine import decode
    from dflash_batch.engine.models.target import Target

    from dflash_batch.training.trainer import tapped_hidden
    from tests.helpers import make_drafter
    from tests.scripting import ScriptedDrafts

    target_dir = qwen3_target  # two distinct taps: a per-tap change of scale is not normed away
    draft_dir = make_drafter(
        model_dir, "draft-qwen3-taps-1-3", synthetic.tiny_qwen3_config(), target_layer_ids=[1, 3]
    )
    model, tok, cfg = loading.load_target(target_dir)
    prompt = tok.encode("Count: one two three four")
    reference = (
        prompt + Engine(model, tok, None, config=cfg).generate(prompt, max_tokens=60).token_ids
    )
    drafter = load_drafter(draft_dir)
    engine = Engine(
        model, tok, drafter, config=cfg, adaptive_block=False
    )  # every cycle drafts the block
    ScriptedDrafts(monkeypatch)(reference, p_wrong=0.2, seed=1)
    real = decode.draft_block
    drafts = []  # (last token, the drafter's own logits [rows, V]) per cycle

    def spy(drafter, target, last, context, counts, cache, rows, with_logits=False, head=None):
        ids, logits = real(drafter, target, last, context, counts, cache, rows, with_logits=True)
        drafts.append((last[0, 0].item(), logits[0]))
        return (ids, logits) if with_logits else ids

    monkeypatch.setattr(decode, "draft_block", spy)
    steps = [
        p.token_ids for p in engine.stream(prompt, max_tokens=60)
    ]  # the prefill's token, then a step per cycle
    seq = prompt + [t for s in steps for t in s]
    assert seq == reference[: len(seq)]
    # Cycle i drafts from the newest token committed before it: position P - 1 + len(steps[0..i]).
    anchors = [len(prompt) - 1 + sum(len(s) for s in steps[: i + 1]) for i in range(len(drafts))]
    assert len({len(s) for s in steps[1:]}) >= 3  # varied acceptance lengths
    assert [seq[p] for p in anchors] == [last for last, _ in drafts]

    B = drafter.args.block_size
    train_target = Target(loading.load_target(target_dir)[0], drafter.args.target_layer_ids)
    context = tapped_hidden(train_target, mx.array([seq]))
    block = mx.array([[seq[p]] + [drafter.args.mask_token_id] * (B - 1) for p in anchors]).reshape(
        1, -1
    )
    trained = objective.block_logits(
        drafter, train_target.lm_head, train_target.embed(block), context, mx.array([anchors])
    )
    for i, (_, logits) in enumerate(drafts):
        rows = logits.shape[0]
        assert mx.allclose(logits, trained[0, i, :rows], atol=1e-4).item(), (
            f"cycle {i} at anchor {anchors[i]}"
        )


def test_follow_up_anchors_are_where_decoding_anchors_next():
    """After a block at p accepts a drafts, decoding's next block starts at p + a + 1 (the bonus
    token); none where no label would follow it or the block had none."""
    tokens = np.arange(100, 120, dtype=np.int32)[None]  # one sequence of 20 tokens
    lengths = np.array([20])
    anchors = np.array([[2, 9, 15, -1]])
    host = objective.blocks_at(tokens, lengths, anchors, 4, 99, gamma=2.0)
    assert not host["weights"][0, 3].any() and host["weights"][0, 2].all()  # -1: no block
    # Logits whose argmax is the label for the first a positions of each block, then wrong.
    accepted = [3, 1, 0, 0]
    logits = np.zeros((1, 4, 3, 128), dtype=np.float32)
    for a, n in enumerate(accepted):
        for k in range(3):
            logits[0, a, k, host["labels"][0, a, k] if k < n else 0] = 1.0
    got = objective.accepted_drafts(
        mx.array(logits), mx.array(host["labels"]), mx.array(host["weights"])
    )
    assert got.tolist() == [accepted]
    nxt = objective.follow_up_anchors(
        host["anchors"], np.array(got), host["weights"][..., 0] > 0, lengths
    )
    assert nxt.tolist() == [[2 + 3 + 1, 9 + 1 + 1, 15 + 0 + 1, -1]]
    late = objective.follow_up_anchors(
        np.array([[17, 18]]), np.array([[1, 0]]), np.array([[True, True]]), lengths
    )
    assert late.tolist() == [
        [-1, 19 if 19 + 1 < 20 else -1]
    ]  # 19 is the last token: no label after it


def tiny_run_argv(target, out, *extra: str) -> list:
    """train-drafter's arguments for a tiny run (24 prompts, 2 steps of 4 sequences x 8 anchors,
    a one-layer fp32 drafter), then ``extra``."""
    return [
        "--target", str(target), "--out", str(out), "--prompts", "24", "--eval-percent", "20",
        "--max-answer-tokens", "24", "--gen-batch", "16", "--steps", "2", "--batch-size", "4", "--anchors", "8",
        "--max-len", "96", "--layers", "1", "--taps", "2", "--warmup", "1", "--quantize-bits", "0",
        "--export-dtype", "float32", *extra,
    ]  # fmt: skip


def tiny_trainer(target, data, out, **options):
    """A set-up Trainer over a tiny run's stored answers (as ``tiny_run_argv``'s), training only."""
    from dflash_batch.training.trainer import TrainConfig, Trainer

    trainer = Trainer(TrainConfig(out=str(out), target=str(target), data=str(data), train_only=True, steps=1,
                                  layers=1, num_taps=2, max_len=96, batch_size=4, anchors=8, **options),
                      log=lambda _: None)  # fmt: skip
    trainer.setup()
    return trainer


def test_follow_anchor_training(tiny_target, tmp_path, capsys):
    """--follow-anchors: the drawn anchors and, beside them, the follow-ups of a random share of
    them, from the drafter as it is at that step; the evaluation reports tau_follow."""
    out = tmp_path / "run"
    argv = tiny_run_argv(tiny_target, out, "--eval-every", "1", "--follow-anchors", "0.25")
    assert cli.main(argv) == 0
    log = [json.loads(line) for line in (out / "train.log.jsonl").read_text().splitlines()]
    final = [e["final_eval"] for e in log if "final_eval" in e][-1]
    assert 1.0 <= final["tau_follow"] <= 4.0 and 1.0 <= final["tau"] <= 4.0

    # --evaluate: the same evaluation of an exported drafter (fp32 here), its shape read from it.
    capsys.readouterr()
    same = [
        "--batch-size",
        "4",
        "--anchors",
        "8",
        "--max-len",
        "96",
    ]  # what the evaluation draws depends on
    assert (
        cli.main(
            ["--target", str(tiny_target), "--out", str(out), "--evaluate", str(out / "drafter")]
            + same
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["eval_samples"] == 3
    for k in ("loss", "tau", "acc_pos1", "tau_follow"):
        assert got[k] == pytest.approx(final[k], abs=1e-4), k
    assert (
        cli.main(
            [
                "--target",
                str(tiny_target),
                "--out",
                str(out),
                "--evaluate",
                str(tmp_path / "nowhere"),
            ]
        )
        == 2
    )

    trainer = tiny_trainer(tiny_target, out / "data", tmp_path / "spy", follow_anchors=0.25)
    samples = trainer.train_samples[:4]
    emb, context, anchors, labels, weights, _ = trainer._inputs(samples, np.random.default_rng(5))
    assert anchors.shape == (4, 8)
    drawn = objective.make_batch(samples, np.random.default_rng(5), 6, trainer.cfg.block_size,
                                 trainer.meta["mask_token_id"], trainer.cfg.gamma, 96, 96)  # fmt: skip
    assert (np.array(anchors[:, :6]) == drawn["anchors"]).all()  # the drawn six come first
    # Each follow-up: p + (drafts the drafter gets right from p) + 1, for some drawn p.
    raw = np.where(
        drawn["weights"][..., 0] > 0, drawn["anchors"], -1
    )  # -1: the sequence had no anchor
    full = objective.blocks_at(drawn["tokens"], drawn["lengths"], raw, trainer.cfg.block_size,
                               trainer.meta["mask_token_id"], trainer.cfg.gamma)  # fmt: skip
    e, a, lab, w = trainer._blocks(full)
    best = np.array(
        mx.argmax(
            objective.block_logits(trainer.drafter, trainer.target.lm_head, e, context, a), axis=-1
        )
    )
    for i in range(4):
        expected = set()
        for p, guess, label, weight in zip(
            drawn["anchors"][i], best[i], full["labels"][i], full["weights"][i]
        ):
            if weight[0] == 0:
                expected.add(None)  # no block at p: no follow-up either
                continue
            run = 0
            while run < len(label) and weight[run] > 0 and guess[run] == label[run]:
                run += 1
            q = int(p) + run + 1
            expected.add(q if q + 1 < drawn["lengths"][i] else None)
        for col in (6, 7):
            got = int(anchors[i, col].item()) if float(weights[i, col, 0].item()) > 0 else None
            assert got in expected, (i, col, got, expected)
    assert float(weights[:, 6:].sum().item()) > 0  # some follow-ups have labels

    with pytest.raises(SystemExit) as refused:
        cli.main(argv[:-1] + ["0.7"])
    assert refused.value.code == 2


def test_distillation_reads_the_targets_own_distribution(tiny_target, tmp_path):
    """--distill: the teacher of block position k of an anchor-p block is the target's own logits
    at position p+k-1 (a full causal forward), and the loss mixes the two cross-entropies."""
    out = tmp_path / "run"
    argv = tiny_run_argv(tiny_target, out, "--distill", "0.5")
    assert cli.main(argv) == 0
    log = [json.loads(line) for line in (out / "train.log.jsonl").read_text().splitlines()]
    assert np.isfinite([e["final_eval"]["loss"] for e in log if "final_eval" in e]).all()
    with pytest.raises(SystemExit) as refused:
        cli.main(argv[:-1] + ["1.5"])
    assert refused.value.code == 2

    trainer = tiny_trainer(tiny_target, out / "data", tmp_path / "spy", distill=1.0)
    samples = trainer.train_samples[:4]
    rng = np.random.default_rng(3)
    emb, context, anchors, labels, weights, teacher = trainer._inputs(samples, rng)
    host = objective.make_batch(samples, np.random.default_rng(3), 8, trainer.cfg.block_size,
                                trainer.meta["mask_token_id"], trainer.cfg.gamma, 96, 96)  # fmt: skip
    full, _ = trainer.target(
        mx.array(host["tokens"]), cache=None
    )  # [N, T, V]: the target's own logits
    B = trainer.cfg.block_size
    has = np.array(weights) > 0
    assert has.sum() > 20
    for shift, same in ((-1, True), (0, False)):  # position p+k-1 predicts x_{p+k}; p+k does not
        pos = np.clip(
            host["anchors"][:, :, None] + np.arange(1, B)[None, None, :] + shift,
            0,
            full.shape[1] - 1,
        )
        want = np.take_along_axis(np.array(full), pos.reshape(4, -1, 1), axis=1).reshape(
            teacher.shape
        )
        close = np.abs(np.array(teacher) - want).max(axis=-1) < 1e-4
        assert close[has].all() == same
    # The greedy label is the teacher's argmax (the answers are the target's greedy ones).
    assert (np.array(mx.argmax(teacher, axis=-1))[has] == np.array(labels)[has]).mean() > 0.95

    # The loss: distill 0 is the plain objective; a one-hot teacher at the labels gives the same
    # loss at any share; a teacher elsewhere does not.
    args = (trainer.drafter, trainer.target.lm_head, emb, context, anchors, labels, weights)
    plain = objective.dflash_loss(*args)[0].item()
    assert objective.dflash_loss(*args, teacher, 0.0)[0].item() == plain
    onehot = mx.where(mx.arange(teacher.shape[-1]) == labels[..., None], 60.0, -60.0)
    assert objective.dflash_loss(*args, onehot, 1.0)[0].item() == pytest.approx(plain, rel=1e-4)
    assert objective.dflash_loss(*args, onehot, 0.5)[0].item() == pytest.approx(plain, rel=1e-4)
    other = mx.where(
        mx.arange(teacher.shape[-1]) == (labels[..., None] + 1) % teacher.shape[-1], 60.0, -60.0
    )
    assert abs(objective.dflash_loss(*args, other, 1.0)[0].item() - plain) > 0.05

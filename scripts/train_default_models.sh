#!/usr/bin/env bash
# Trains the default models (target LM, draft LM, Medusa, EAGLE-1 and EAGLE-3 heads, DFlash) and installs them
# into specjax/default_models with a model card. Meant for the GPU machine:
#     PYTHONPATH=. scripts/train_default_models.sh [RUNS_DIR]
# QUICK=1 runs every stage with a few steps on a few files (a CPU smoke test of the pipeline; its
# models are not worth shipping, so it installs into RUNS_DIR/default_models instead).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-runs/default}
python=${PYTHON:-python3}
install_dir=specjax/default_models
quick=()
lm_quick=()
head_quick=()
if [ "${QUICK:-0}" = 1 ]; then
  quick=(--set optimizer.total_steps=12 --set optimizer.warmup_steps=2 --set data.max_files=40
         --set data.held_out_fraction=0.25 --set data.seq_len=64 --set data.batch_size=4 --set checkpoint_every=6
         --set log_every=2)
  lm_quick=(--set data.vocab_size=512)
  head_quick=(--set eval_prompts=4 --set eval_prompt_len=32 --set eval_new_tokens=16)
  install_dir=$runs/default_models
fi
# Re-running the script skips finished stages and resumes an interrupted one from its last checkpoint.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$runs/jax_cache}
train() {  # train STAGE_DIR SPECJAX_ARGS...: skipped when the stage's eval.json (written last) exists
  local stage=$1; shift
  if compgen -G "$runs/$stage/*/eval.json" >/dev/null; then echo "$stage: done, skipped"; return; fi
  "$python" -m specjax.cli "$@"
}
# MTP modules for the trained target (configs/train/default_mtp.yaml; the bundled default:target where none was
# trained in RUNS_DIR): one module, and three (mtp3), on the DFlash stage's regenerated text where it is there
# (the same recipe and seed). STAGES=mtp runs only this stage, then installs MTP_SHIP (mtp or mtp3; default mtp)
# as default:mtp.
mtp_stage() {
  local target=default:target cache=()
  if [ -d "$runs/target/model" ]; then target="$runs/target/model"; cache=(--set data.cache_dir="$runs/target"); fi
  [ "${QUICK:-0}" = 1 ] && cache+=(--set regenerate_sequences=16 --set regenerate_prompt_len=16)
  for variant in mtp mtp3; do
    modules=1; [ "$variant" = mtp3 ] && modules=3
    mkdir -p "$runs/$variant"
    if [ -f "$runs/dflash/regenerated.npy" ] && [ ! -f "$runs/$variant/regenerated.npy" ]; then
      cp "$runs/dflash/regenerated.npy" "$runs/$variant/"
    fi
    train "$variant" train-mtp --config configs/train/default_mtp.yaml --set num_modules="$modules" \
      --set target="$target" --set output_dir="$runs/$variant" "${cache[@]}" "${quick[@]}" "${head_quick[@]}"
  done
  "$python" scripts/install_mtp.py --run "$runs/${MTP_SHIP:-mtp}" --target "$target" --out "$install_dir/mtp"
}
if [ "${STAGES:-}" = mtp ]; then mtp_stage; exit 0; fi

train target train-lm --config configs/train/default_target.yaml --set output_dir="$runs/target" \
  "${quick[@]}" "${lm_quick[@]}"
# Later stages reuse the target's tokenizer and token files (data.cache_dir) instead of re-tokenizing.
train draft train-lm --config configs/train/default_draft.yaml --set output_dir="$runs/draft" \
  --set data.tokenizer="$runs/target/model" --set data.cache_dir="$runs/target" "${quick[@]}"
for head in medusa eagle1 eagle3; do
  command=train-eagle; [ "$head" = medusa ] && command=train-medusa
  train "$head" "$command" --config "configs/train/default_$head.yaml" --set target="$runs/target/model" \
    --set output_dir="$runs/$head" --set data.cache_dir="$runs/target" "${quick[@]}" "${head_quick[@]}"
done
train dflash train-dflash --config configs/train/default_dflash.yaml --set target="$runs/target/model" \
  --set output_dir="$runs/dflash" --set data.cache_dir="$runs/target" "${quick[@]}" "${head_quick[@]}"
"$python" scripts/make_model_card.py --runs "$runs" --out "$install_dir"
mtp_stage

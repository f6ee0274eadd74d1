#!/usr/bin/env bash
# Trains the default models (target LM, draft LM, Medusa, EAGLE-1 and EAGLE-3 heads, DFlash, DSpark, MTP) and installs
# them into specjax/default_models with a model card. Meant for the GPU machine:
#     PYTHONPATH=. scripts/train_default_models.sh [RUNS_DIR]
# STAGES="dspark" (a space-separated list of target draft medusa eagle1 eagle3 dflash dspark mtp
# mtp3; default all) runs only those stages and installs only what they trained (--dflash-run / --dspark-run /
# scripts/install_mtp.py): a drafter stage without
# RUNS_DIR/target/model trains for the bundled target (specjax/default_models/target) and writes the token files
# it needs under RUNS_DIR/target again. E.g. the DSpark drafter alone, on the GPU machine:
#     PYTHONPATH=. STAGES=dspark scripts/train_default_models.sh runs/default
# RECIPE=code trains configs/train/code_*.yaml instead of default_*.yaml (the ~100M-parameter code target of
# benchmarks/code_target.sh) and installs nothing; CORPUS_DIR=DIR sets every stage's data.corpus_dir (default:
# the standard library); EXTRA_SETS="--set KEY=VALUE ..." adds overrides to every stage (e.g. fewer steps, to time
# the stages on a new machine).
# QUICK=1 runs every stage with a few steps on a few files (a CPU smoke test of the pipeline; its
# models are not worth shipping, so it installs into RUNS_DIR/default_models instead, and with STAGES set
# installs nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-runs/default}
python=${PYTHON:-python3}
install_dir=specjax/default_models
recipe=${RECIPE:-default}
corpus=(); [ -n "${CORPUS_DIR:-}" ] && corpus=(--set data.corpus_dir="$CORPUS_DIR")
extra=(); [ -n "${EXTRA_SETS:-}" ] && read -ra extra <<< "$EXTRA_SETS"
quick=()
lm_quick=()
head_quick=()
block_quick=()
if [ "${QUICK:-0}" = 1 ]; then
  quick=(--set optimizer.total_steps=12 --set optimizer.warmup_steps=2 --set data.max_files=40
         --set data.held_out_fraction=0.25 --set data.seq_len=64 --set data.batch_size=4 --set checkpoint_every=6
         --set log_every=2)
  lm_quick=(--set data.vocab_size=512)
  head_quick=(--set eval_prompts=4 --set eval_prompt_len=32 --set eval_new_tokens=16)
  block_quick=(--set regenerate_sequences=64 --set regenerate_prompt_len=16 --set num_anchors=4)
  install_dir=$runs/default_models
fi
# Re-running the script skips finished stages and resumes an interrupted one from its last checkpoint.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$runs/jax_cache}
stages=${STAGES:-all}
[[ " $stages " == *" mtp "* ]] && stages="$stages mtp3"  # the stage mtp trains one module and three
wanted() { [ "$stages" = all ] || [[ " $stages " == *" $1 "* ]]; }
train() {  # train STAGE_DIR SPECJAX_ARGS...: skipped when the stage's eval.json (written last) exists or not in STAGES
  local stage=$1; shift
  wanted "$stage" || return 0
  if compgen -G "$runs/$stage/*/eval.json" >/dev/null; then echo "$stage: done, skipped"; return; fi
  local config=$stage; [ "$stage" = mtp3 ] && config=mtp  # mtp3: the mtp config with three modules
  local command=$1; config=configs/train/${recipe}_$config.yaml; shift
  "$python" -m specjax.cli "$command" --config "$config" "$@" "${corpus[@]}" "${extra[@]}"
}
own_text() {  # own_text STAGE: an earlier stage's regenerated text copied for STAGE (the same recipe, seed and
  # shape: DSpark's and MTP's configs regenerate what DFlash's does; a shape that differs is refused by name). A stage
  # started beside DFlash finds none yet and regenerates its own; mtp3 then copies mtp's.
  if [ "$1" = dflash ] || ! wanted "$1"; then return 0; fi
  mkdir -p "$runs/$1"
  local source
  for source in dflash dspark mtp; do
    if [ -f "$runs/$source/regenerated.npy" ] && [ ! -f "$runs/$1/regenerated.npy" ]; then
      cp "$runs/$source/regenerated.npy" "$runs/$1/"; return 0
    fi
  done
}
# The drafters' target: the one trained here, or where its stage did not run here, the bundled one.
target_model=$runs/target/model
if [ "$stages" != all ] && [[ " $stages " != *" target "* ]] && [ ! -e "$target_model/config.json" ]; then
  target_model=default:target
fi

train target train-lm --set output_dir="$runs/target" \
  "${quick[@]}" "${lm_quick[@]}"
# Later stages reuse the target's tokenizer and token files (data.cache_dir) instead of re-tokenizing.
train draft train-lm --set output_dir="$runs/draft" \
  --set data.tokenizer="$target_model" --set data.cache_dir="$runs/target" "${quick[@]}"
for head in medusa eagle1 eagle3; do
  command=train-eagle; [ "$head" = medusa ] && command=train-medusa
  train "$head" "$command" --set target="$target_model" \
    --set output_dir="$runs/$head" --set data.cache_dir="$runs/target" "${quick[@]}" "${head_quick[@]}"
done
for block in dflash dspark; do
  own_text "$block"
  train "$block" "train-$block" --set target="$target_model" \
    --set output_dir="$runs/$block" --set data.cache_dir="$runs/target" "${quick[@]}" "${head_quick[@]}" \
    "${block_quick[@]}"
done
# MTP modules for the target (configs/train/default_mtp.yaml): one module, and three (mtp3, with the stage mtp), on
# the DFlash stage's regenerated text where it is there (the same recipe and seed).
for variant in mtp mtp3; do
  modules=1; [ "$variant" = mtp3 ] && modules=3
  own_text "$variant"
  mtp_quick=(); [ "${QUICK:-0}" = 1 ] && mtp_quick=(--set regenerate_sequences=64 --set regenerate_prompt_len=16)  # block_quick's: the copy fits
  train "$variant" train-mtp --set num_modules="$modules" \
    --set target="$target_model" --set output_dir="$runs/$variant" --set data.cache_dir="$runs/target" \
    "${quick[@]}" "${head_quick[@]}" "${mtp_quick[@]}"
done
# MTP_SHIP (mtp or mtp3; default mtp) is installed as default:mtp.
install_mtp() { "$python" scripts/install_mtp.py --run "$runs/${MTP_SHIP:-mtp}" --target "$target_model" --out "$install_dir/mtp"; }
if [ "$recipe" != default ]; then
  echo "RECIPE=$recipe: nothing installed (the runs are in $runs)"
elif [ "$stages" = all ]; then
  "$python" scripts/make_model_card.py --runs "$runs" --out "$install_dir"
  install_mtp
elif [ "${QUICK:-0}" = 1 ]; then
  echo "QUICK=1 with STAGES=$stages: nothing installed"
else
  installs=()
  for block in dflash dspark; do
    [[ " $stages " == *" $block "* ]] && installs+=("--$block-run" "$runs/$block")
  done
  if [ ${#installs[@]} -gt 0 ]; then "$python" scripts/make_model_card.py "${installs[@]}" --out "$install_dir"; fi
  if [[ " $stages " == *" mtp"* ]]; then install_mtp; fi
fi

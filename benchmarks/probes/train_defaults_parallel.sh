#!/usr/bin/env bash
# Trains default drafters for the bundled target side by side on one GPU (the stages of
# scripts/train_default_models.sh, each its own process), installs each finished one in bfloat16 as the package
# stores it, and packs them for a device call's $OUT (at most 8 files of 16 MiB come back).
#     PYTHONPATH=. benchmarks/probes/train_defaults_parallel.sh start RUNS "eagle3 dspark mtp mtp3"
#     PYTHONPATH=. benchmarks/probes/train_defaults_parallel.sh wait RUNS SECONDS OUT
# `start` detaches the runs (setsid), so that a second device call on the same warm machine can `wait` for
# runs that outlast one call's ten minutes; each run resumes from its checkpoints if started again. `wait`
# returns when every run has ended or after SECONDS, then writes OUT/logs.tar (logs, metrics, eval.json) and
# OUT/models_STAGE.tar for each installed stage (unpack into specjax/default_models/). EXTRA_SETS="--set K=V ..."
# is added to every stage's command (a CPU smoke test: a few steps).
set -u
mode=$1; runs=$2
target=specjax/default_models/target
export XLA_FLAGS=--xla_gpu_enable_triton_gemm=false XLA_PYTHON_CLIENT_PREALLOCATE=false
stage_command() {  # the train command of one stage, as scripts/train_default_models.sh runs it
  local common=(--set target="$target" --set output_dir="$runs/$1" --set data.cache_dir="$runs/tokens_$1" ${EXTRA_SETS:-})
  case $1 in
    eagle3) echo train-eagle --config configs/train/default_eagle3.yaml "${common[@]}" ;;
    dspark) echo train-dspark --config configs/train/default_dspark.yaml "${common[@]}" ;;
    mtp) echo train-mtp --config configs/train/default_mtp.yaml --set num_modules=1 "${common[@]}" ;;
    mtp3) echo train-mtp --config configs/train/default_mtp.yaml --set num_modules=3 "${common[@]}" ;;
    *) echo "unknown stage $1 (allowed: eagle3 dspark mtp mtp3)" >&2; exit 2 ;;
  esac
}
if [ "$mode" = start ]; then
  for stage in $3; do
    mkdir -p "$runs/$stage"
    command=$(stage_command "$stage") || exit 2
    setsid bash -c "python3 -m specjax.cli $command > $runs/$stage/log.txt 2>&1; echo exit \$? >> $runs/$stage/log.txt" \
      < /dev/null > /dev/null 2>&1 &
  done
  exit 0
fi
seconds=$3; out=$4
deadline=$(( $(date +%s) + seconds ))
while [ "$(date +%s)" -lt "$deadline" ]; do
  running=0
  for log in "$runs"/*/log.txt; do grep -qs "^exit" "$log" || running=1; done
  [ $running = 0 ] && break
  sleep 5
done
installed=$runs/installed; mkdir -p "$installed"
for log in "$runs"/*/log.txt; do
  stage=$(basename "$(dirname "$log")"); echo "== $stage: $(tail -n 1 "$log")"
  grep -qs "^exit 0" "$log" || continue
  JAX_PLATFORMS=cpu python3 - "$stage" "$runs/$stage" "$installed/$stage" "$target" <<'PY' || continue
import dataclasses, shutil, sys
from pathlib import Path
from specjax.models import hf
stage, run, out, target = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
config = dataclasses.replace(hf.load_config(target), param_dtype="bfloat16", dtype="bfloat16")
if stage == "eagle3":
    from specjax.models.eagle import load_eagle, save_eagle
    save_eagle(load_eagle(run / "head", config), out); shutil.copy(run / "head/eval.json", out)
elif stage == "dspark":
    from specjax.models.dspark import load_dspark, save_dspark
    save_dspark(load_dspark(run / "drafter", dtype="bfloat16"), out); shutil.copy(run / "drafter/eval.json", out)
else:
    from specjax.models.mtp import load_mtp, save_mtp
    save_mtp(load_mtp(run / "mtp", config), out); shutil.copy(run / "mtp/eval.json", out)
print("installed", out)
PY
  tar -cf "$out/models_$stage.tar" -C "$installed" "$stage"
done
tar -cf "$out/logs.tar" --ignore-failed-read $(ls -d "$runs"/*/log.txt "$runs"/*/metrics.jsonl "$runs"/*/*/eval.json 2>/dev/null)
ls -la "$out"

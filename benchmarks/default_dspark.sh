#!/usr/bin/env bash
# default:dspark (issue 39) on the GPU machine: trains DSpark for the bundled target (configs/train/default_dspark.yaml,
# scripts/train_default_models.sh's dspark stage), installs it into specjax/default_models/dspark with the model
# card, compares it with DFlash (scripts/dspark_eval.py), and leaves under OUT what to commit: OUT/default_models/
# (the installed files and the card), OUT/dspark_eval/, and the run's own drafter (float32) in OUT/dspark_run/.
#     PYTHONPATH=. benchmarks/default_dspark.sh OUT [RUNS]
# It outlasts one device call (2026-12-04: the regenerated text 2.5 min, 8,000 steps 5.5, the card's evals and the
# comparison after them), so on that machine:
#     PYTHONPATH=. benchmarks/default_dspark.sh start [RUNS]   # into /tmp/default_dspark, in its own session (setsid)
#     benchmarks/default_dspark.sh wait OUT [S]                # waits at most S seconds (default 560), copies it to OUT
# each call made within the machine's idle release of the previous one (a call's OUT is its own).
set -uo pipefail
mode=run
case ${1:-} in start|wait) mode=$1; shift ;; esac
staged=/tmp/default_dspark
case $mode in
  start)
    mkdir -p $staged
    setsid nohup bash "$0" $staged "${1:-/tmp/runs_default}" > $staged/default_dspark.log 2>&1 < /dev/null &
    echo "started: $staged/default_dspark.log"; exit 0 ;;
  wait)
    out=${1:?usage: benchmarks/default_dspark.sh wait OUT [S]}
    for _ in $(seq "${2:-560}"); do grep -q "^EXIT" $staged/default_dspark.log 2>/dev/null && break; sleep 1; done
    tail -c 3000 $staged/default_dspark.log; cp -r $staged/. "$out/"; exit 0 ;;
esac
out=${1:?usage: benchmarks/default_dspark.sh [start [RUNS] | wait OUT [S] | OUT [RUNS]]}
set -e
runs=${2:-/tmp/runs_default}
python=${PYTHON:-python3}
trap 'echo "EXIT $?"' EXIT
STAGES=dspark PYTHON=$python bash scripts/train_default_models.sh "$runs" > "$runs.log" 2>&1 || {
  tail -c 3000 "$runs.log"; exit 1; }
tail -c 1500 "$runs.log"
mkdir -p "$out/dspark_run" "$out/default_models"
cp "$runs"/dspark/drafter/* "$out/dspark_run/"
# The stage installs it; on 2026-12-04 the device's copy came back without it (cause not found), so install again
# where it is missing rather than lose the run.
[ -f specjax/default_models/dspark/model.safetensors.xz ] || \
  "$python" scripts/make_model_card.py --dspark-run "$runs/dspark" --out specjax/default_models
cp -r specjax/default_models/dspark specjax/default_models/MODEL_CARD.md specjax/default_models/model_card.json \
  "$out/default_models/"
"$python" scripts/dspark_eval.py --out "$out/dspark_eval"

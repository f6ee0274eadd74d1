#!/usr/bin/env bash
# default:dspark (issue 39) on the GPU machine in one device call: trains DSpark for the bundled target
# (configs/train/default_dspark.yaml, scripts/train_default_models.sh's dspark stage), installs it into
# specjax/default_models/dspark with the model card, compares it with DFlash (scripts/dspark_eval.py), and leaves
# under OUT what to commit: OUT/default_models/ (the installed files and the card) and OUT/dspark_eval/.
#     PYTHONPATH=. benchmarks/default_dspark.sh OUT [RUNS]
set -euo pipefail
out=${1:?usage: benchmarks/default_dspark.sh OUT [RUNS]}
runs=${2:-/tmp/runs_default}
python=${PYTHON:-python3}
STAGES=dspark PYTHON=$python bash scripts/train_default_models.sh "$runs" > "$runs.log" 2>&1 || {
  tail -c 3000 "$runs.log"; exit 1; }
tail -c 1500 "$runs.log"
mkdir -p "$out/default_models/dspark"
cp specjax/default_models/dspark/* "$out/default_models/dspark/"
cp specjax/default_models/MODEL_CARD.md specjax/default_models/model_card.json "$out/default_models/"
"$python" scripts/dspark_eval.py --out "$out/dspark_eval"

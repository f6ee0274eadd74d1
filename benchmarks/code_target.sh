#!/usr/bin/env bash
# The ~100M-parameter code target and its drafters (issue 41), on the GPU machine, in one command:
#     PYTHONPATH=. benchmarks/code_target.sh RUNS OUT
# trains the target on the interpreter's site-packages (Python files outside tests; CORPUS_DIR to change),
# then Medusa, EAGLE-1, EAGLE-3 and DFlash on it (scripts/train_default_models.sh with RECIPE=code:
# configs/train/code_*.yaml; STAGES to choose, e.g. STAGES="target dspark mtp" for the other drafters), then
# the Spec-Bench-style table (python -m specjax.spec_bench; SPEC_BENCH_FLAGS for more flags), and packs every metric, eval and table into OUT: code_target.md (what each
# stage took and gave), spec_bench.md / .png, and code_target.tar.xz (the stages' metrics.jsonl, eval.json and
# the table's rows). The weights stay in RUNS. Each stage's start and end are stamped in RUNS/pipeline.log.
# The device's calls last 10 minutes at most and the whole run longer, so on that machine:
#     benchmarks/code_target.sh start RUNS        # the pipeline in its own session (setsid), returning at once
#     benchmarks/code_target.sh wait RUNS OUT [S] # waits for it at most S seconds (default 560), then packs OUT
# each call made within the machine's idle release of the previous one. QUICK=1 is the CPU smoke test
# (train_default_models.sh's; the table then takes SPEC_BENCH_FLAGS, e.g. --num-prompts 2 --new-tokens 8).
# Time on the H200 (the full run of 2026-12-04, benchmarks/results/code_target/2026-12-04/): the target 4.9 minutes
# (its corpus prepared in about one), the four drafters side by side 9.3 (DFlash's 4,000 steps and its regenerated
# sequences the longest), the table 12.9: 27 minutes, one session's device time. DSpark and MTP need a session of
# their own: STAGES="target dflash dspark mtp" WAVES="dflash dspark mtp"
# SPEC_BENCH_FLAGS="--drafters dflash,dspark,mtp,mtp3" (2026-12-07 on an H100: the target 4.2 minutes, the drafters
# 9.3 and DSpark's re-run alone 2.9, the table's first three categories 3.7:
# benchmarks/results/code_target/2026-12-07_dspark_mtp/). The two categories it did not reach:
# WAVES="dflash mtp;dspark" SPEC_BENCH_FLAGS="--drafters dflash,dspark,mtp,mtp3 --categories tests,long_context"
# (2026-12-07 on an H100: 20.6 minutes, the table 4.5 of them; .../2026-12-07b_dspark_mtp_rest/).
set -uo pipefail
mode=run
case ${1:-} in start|wait|pack) mode=$1; shift ;; esac
runs=${1:-runs/code}
out=${2:-benchmarks/results/code_target}
python=${PYTHON:-python3}
corpus=${CORPUS_DIR:-$("$python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")}
stages=${STAGES:-target medusa eagle1 eagle3 dflash}
# The drafter stages' waves, separated by ';': a stage starts with its wave. WAVES="dflash dspark mtp" runs DSpark
# and MTP beside DFlash, each regenerating its own text (the same recipe and seed), which saves DFlash's training time.
waves=${WAVES:-medusa eagle1 eagle3 dflash;dspark mtp}
log=$runs/pipeline.log
stamp() { echo "$(date -u +%FT%TZ) $*" >> "$log"; }

run_stage() {  # one stage of scripts/train_default_models.sh, its output in RUNS/STAGE.log
  stamp "stage $1 start"
  # Training without XLA's Triton GEMMs: 444k against 417k tok/s for this target's shape on the H200
  # (docs/performance.md, "Training at scale"); the table's decoding keeps XLA's defaults.
  if XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" RECIPE=code CORPUS_DIR=$corpus STAGES=$1 \
      PYTHON=$python bash scripts/train_default_models.sh "$runs" > "$runs/$1.log" 2>&1; then
    stamp "stage $1 end"
  else
    stamp "stage $1 failed"; return 1
  fi
}

pipeline() {
  mkdir -p "$runs"
  stamp "pipeline start: corpus $corpus, stages $stages"
  local status=0
  [[ " $stages " != *" target "* ]] || run_stage target || { stamp "pipeline end (status 1)"; return 1; }
  # The drafters side by side, each its own process on the one GPU (small models leave most of it idle: one
  # alone keeps it busy a fraction of each step); DSpark and MTP after DFlash, whose regenerated text they reuse.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  # Four processes can exhaust the GPU's memory between them (EAGLE-3 did on 2026-12-04), so a stage that fails
  # in its wave is run once more alone after it.
  local wave_list; IFS=';' read -ra wave_list <<< "$waves"
  for wave in "${wave_list[@]}"; do
    local pids=() names=() failed=()
    for stage in $wave; do
      [[ " $stages " == *" $stage "* ]] || continue
      run_stage "$stage" & pids+=($!); names+=("$stage")
    done
    for i in "${!pids[@]}"; do wait "${pids[$i]}" || failed+=("${names[$i]}"); done
    for stage in "${failed[@]}"; do
      stamp "retrying $stage alone"
      run_stage "$stage" || status=1
    done
  done
  stamp "stage spec_bench start"
  # shellcheck disable=SC2086  # the flags are words
  if "$python" -m specjax.spec_bench --runs "$runs" --corpus-dir "$corpus" --out "$runs/spec_bench" \
      ${SPEC_BENCH_FLAGS:-} > "$runs/spec_bench.log" 2>&1; then
    stamp "stage spec_bench end"
  else
    stamp "stage spec_bench failed"; status=1
  fi
  stamp "pipeline end (status $status)"
  return $status
}

pack() {
  mkdir -p "$out"
  "$python" - "$runs" "$out" <<'EOF'
import json, sys, tarfile
from datetime import datetime
from pathlib import Path

runs, out = Path(sys.argv[1]), Path(sys.argv[2])
lines = (runs / "pipeline.log").read_text().splitlines() if (runs / "pipeline.log").exists() else []
starts, rows = {}, []


def pace(stage):
    """Seconds a step between the stage's first and last logged steps (the first log's steps hold the compilation;
    a checkpoint in between counts), and tokens a second at its run_config.json's batch x seq_len."""
    path = runs / stage / "metrics.jsonl"
    logged = [r for r in map(json.loads, path.read_text().splitlines()) if "time" in r] if path.exists() else []
    if len(logged) < 2:
        return ""
    step_s = (logged[-1]["time"] - logged[0]["time"]) / (logged[-1]["step"] - logged[0]["step"])
    config = runs / stage / "run_config.json"
    data = json.loads(config.read_text())["data"] if config.exists() else {}
    tokens = data.get("batch_size", 0) * data.get("seq_len", 0)
    return f"{step_s:.3f}" + (f", {tokens / step_s:,.0f}" if tokens else "")


for line in lines:
    when, _, what = line.partition(" ")
    words = what.split()
    if words[:1] == ["stage"]:
        if words[2] == "start":
            starts[words[1]] = datetime.fromisoformat(when.replace("Z", "+00:00"))
        else:
            minutes = (datetime.fromisoformat(when.replace("Z", "+00:00")) - starts[words[1]]).total_seconds() / 60
            evals = sorted((runs / words[1]).glob("*/eval.json")) if words[2] == "end" else []
            result = json.loads(evals[0].read_text()) if evals else {}
            shown = {k: v for k, v in result.items() if isinstance(v, (int, float, str)) and len(str(v)) < 40}
            rows.append(f"| {words[1]} | {words[2]} | {minutes:.1f} | {pace(words[1]) if words[2] == 'end' else ''} | "
                        f"{json.dumps(shown)} |")
md = ["# The code target and its drafters", "", f"Runs: {runs}; the pipeline's log:", "", "```", *lines, "```", "",
      "| stage | state | minutes | s a step, tokens/s (first to last logged step; run_config.json's batch x seq_len) | eval.json |",
      "|---|---|---|---|---|", *rows, ""]
(out / "code_target.md").write_text("\n".join(md))
with tarfile.open(out / "code_target.tar.xz", "w:xz") as tar:
    for pattern in ("*/metrics.jsonl", "*/run_config.json", "*/*/eval.json", "*/*/config.json", "spec_bench/spec_bench.*",
                    "spec_bench/prompts.json", "*.log"):
        for path in sorted(runs.glob(pattern)):
            tar.add(path, arcname=str(path.relative_to(runs)))
for name in ("spec_bench.md", "spec_bench.png"):
    if (runs / "spec_bench" / name).exists():
        (out / name).write_bytes((runs / "spec_bench" / name).read_bytes())
print((out / "code_target.md").read_text())
EOF
}

case $mode in
  run) pipeline; status=$?; pack; exit $status ;;
  start)
    mkdir -p "$runs"
    export -f pipeline run_stage stamp
    export runs corpus stages waves log python
    setsid bash -c pipeline > "$runs/pipeline.out" 2>&1 < /dev/null &
    echo "pipeline started (pid $!), log $log"
    ;;
  wait)
    for _ in $(seq "${3:-560}"); do
      grep -q "pipeline end" "$log" 2> /dev/null && break
      sleep 1
    done
    for stage_log in "$runs"/*.log; do echo "== $stage_log"; tail -c 600 "$stage_log"; echo; done; pack
    ;;
  pack) pack ;;
esac

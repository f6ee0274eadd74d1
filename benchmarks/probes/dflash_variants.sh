#!/usr/bin/env bash
# Trains DFlash variants for default:target side by side on one GPU: configs/train/default_dflash.yaml with
# each variant's --set overrides. Per variant, OUT/NAME/ gets log.txt, metrics.jsonl, eval.json (the closing
# eval: greedy, K 15, 64 new tokens) and bundled/ (the drafter in bfloat16, as the package stores it).
#     PYTHONPATH=. benchmarks/probes/dflash_variants.sh OUT NAME "KEY=VALUE ..." [NAME "KEY=VALUE ..." ...]
# RUN_LIMIT_S (default 560) stops a run that would outlast a device call. SHARE_REGENERATED=1: the variants
# after the first wait for its regenerated.npy and train on it (right only when they ask for the same
# regenerate_* settings, seed and data.seq_len: the sequences are a function of those). Results of 2026-12-02:
# benchmarks/results/default_models_training/dflash_variants.md.
set -u
out=$1; shift
deadline=$(( $(date +%s) + ${RUN_LIMIT_S:-560} ))
export XLA_FLAGS=--xla_gpu_enable_triton_gemm=false XLA_PYTHON_CLIENT_PREALLOCATE=false
while [ $# -ge 2 ]; do
  name=$1; sets=$2; shift 2
  run="runs/variants/$name"
  args=(--set target=default:target --set output_dir="$run")
  for kv in $sets; do args+=(--set "$kv"); done
  mkdir -p "$out/$name" "$run"
  first=${first:-$name}
  (if [ "${SHARE_REGENERATED:-0}" = 1 ] && [ "$name" != "$first" ]; then
     shared="runs/variants/$first/regenerated.npy"  # until it exists or the first run has ended
     until [ -f "$shared" ] || grep -qs "^exit" "$out/$first/log.txt" || [ "$(date +%s)" -ge "$deadline" ]; do
       sleep 2
     done
     [ -f "$shared" ] && ln -sf "$(realpath "$shared")" "$run/regenerated.npy"
   fi
   timeout $(( deadline - $(date +%s) )) python3 -m specjax.cli train-dflash --config configs/train/default_dflash.yaml \
     "${args[@]}" > "$out/$name/log.txt" 2>&1; echo "exit $?" >> "$out/$name/log.txt"
   cp "$run/metrics.jsonl" "$run/drafter/eval.json" "$out/$name/" 2>/dev/null
   JAX_PLATFORMS=cpu python3 -c "import sys; from specjax.models.dflash import load_dflash, save_dflash
save_dflash(load_dflash(sys.argv[1], dtype='bfloat16'), sys.argv[2])" "$run/drafter" "$out/$name/bundled" \
     >> "$out/$name/log.txt" 2>&1) &
done
wait
for d in "$out"/*/; do echo "== $d"; tail -n 1 "$d/log.txt"; head -4 "$d/eval.json" 2>/dev/null; done

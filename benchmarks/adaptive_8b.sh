#!/usr/bin/env bash
# Adaptive verification at the Llama-3.1-8B shape on one GPU (random bfloat16 weights), DFlash K 15 with synthetic
# acceptance drawn from the default DFlash drafter's measured per-position profile (T 0, K 15: the unconditional
# rates below, tau 3.65; benchmarks/results/dflash_k_sweep), each part one 10-minute device call:
#     PYTHONPATH=. benchmarks/adaptive_8b.sh decode B OUT  # generate at batch B: adaptive against fixed K, the
#                                                          # envelope K chosen for B (1: 4, 8; 16: 4, 8; 64: 2, 3, 4)
#         NEW_TOKENS=512: a longer run (at batch 1, 128 tokens are ~36 steps of one row's draws, 16% s.d. between seeds)
#         DECODE_FLAGS=--with-widest-runs: adaptive also with steps held at K in a loop of their own (widest_runs)
#     PYTHONPATH=. benchmarks/adaptive_8b.sh serve OUT [METHODS]  # the engine from 1 to 256 requests:
#         METHODS none,dflash:15::adaptive,dflash:15 (the default), then dflash:2,dflash:4,dflash:8 (the envelope);
#         SERVE_FLAGS="--held-visits on,off,whole": the adaptive engine with held visits, without, and run whole
#         (one load a call: at 64 slots the adaptive engine's programs compile for over 230 s on an H100)
#         One engine of SLOTS (256) slots for loads CONC (1,16,64,256), whose visits step COUNTS (1,16,64,256; the
#         loads' own counts, --step-slot-counts) of them. The adaptive engine's warm-up profiles a cost curve at each
#         count and compiles a loop for it, each a program of 9 branches: about 100 s apiece on an H100 (the
#         nineteenth session's call profiled batches 1 and 2 of the 9 powers of two in 570 s). Within one 10-minute
#         call: SLOTS=16 COUNTS=1,16 CONC=1,16, then SLOTS=256 COUNTS=64,256 CONC=64,256. Each profile is kept in
#         OUT/cost_curves as it completes; CURVES=DIR copies an earlier call's in first.
#     PYTHONPATH=. benchmarks/adaptive_8b.sh probe OUT  # why the adaptive engine's step costs more than the fixed
#         engine's (benchmarks/probes/adaptive_engine_step.py: both engines' ms a step, each visit's, and compiled
#         programs), two requests of NEW_TOKENS (512: ~150 steps in 9-10 visits each) in turn; about 250 s; with
#         VARIANTS=1 then the adaptive engine with every kernel loaded up front (CUDA_MODULE_LOADING=EAGER) and
#         with no command buffers, over 560 s in all (the twenty-second session's call ran out in the last);
#         SHAPE=tiny runs it on the CPU. The probe's docstring gives the commands of the command buffer runs (the
#         VLOG count, +CONDITIONAL, none), which the twenty-first and twenty-second sessions ran
#     PYTHONPATH=. python scripts/bench_decode.py --plot OUT/bench_decode_adaptive_8b_b1.json \
#         OUT/bench_decode_adaptive_8b_b16.json OUT/bench_decode_adaptive_8b_b64.json   # the width against batch
set -uo pipefail
part=$1
export PYTHONUNBUFFERED=1
rates=0.691,0.454,0.327,0.240,0.182,0.138,0.116,0.102,0.082,0.069,0.061,0.055,0.050,0.044,0.041
case $part in
  decode)
    batch=$2; out=${3:-benchmarks/results}
    case $batch in 1) fixed=4,8 ;; 16) fixed=4,8 ;; 64) fixed=2,3,4 ;; *) fixed=2,4,8 ;; esac
    python3 scripts/bench_decode.py --shape 8b --methods dflash --num-speculative-tokens 15 --acceptance-rates $rates \
      --adaptive --fixed-k $fixed --batches $batch --prompt-lens 128 --new-tokens ${NEW_TOKENS:-128} \
      --name bench_decode_adaptive_8b_b$batch --out-dir "$out" ${DECODE_FLAGS:-}
    ;;
  serve)
    out=${2:-benchmarks/results}; methods=${3:-none,dflash:15::adaptive,dflash:15}
    export SPECJAX_COST_CURVE_DIR=$out/cost_curves; mkdir -p $SPECJAX_COST_CURVE_DIR
    [ -z "${CURVES:-}" ] || cp "$CURVES"/*.json $SPECJAX_COST_CURVE_DIR/ 2>/dev/null
    conc=${CONC:-1,16,64,256}
    python3 scripts/bench_serve.py --models 8b --prompt-len 128 --new-tokens 128 --num-requests 8 \
      --max-num-seqs ${SLOTS:-256} --step-slot-counts ${COUNTS:-1,16,64,256} --max-prefill-batch 64 \
      --acceptance-rates $rates --concurrency $conc --methods $methods ${SERVE_FLAGS:-} \
      --name bench_serve_8b_adaptive_$(echo $methods | tr ':,' '_-')_c$(echo $conc | tr ',' '-') --output "$out"
    ;;
  probe)
    out=${2:-benchmarks/results}; mkdir -p "$out"
    probe="python3 benchmarks/probes/adaptive_engine_step.py --shape ${SHAPE:-8b} --new-tokens ${NEW_TOKENS:-512}"
    $probe > "$out/engine_step.txt" 2>&1; cat "$out/engine_step.txt"
    # Then the adaptive engine alone where the device loads each kernel when first launched and where XLA records
    # no command buffers (CUDA graphs): an excess either removes is one of them.
    [ "${VARIANTS:-0}" = 1 ] || exit 0
    for setting in CUDA_MODULE_LOADING=EAGER XLA_FLAGS=--xla_gpu_enable_command_buffer=; do
      echo "$setting:"; env "$setting" $probe --only adaptive > "$out/engine_step_${setting%%=*}.txt" 2>&1
      grep "adaptive engine:" "$out/engine_step_${setting%%=*}.txt"
    done
    ;;
  *) echo "usage: $0 decode B [OUT] | serve [OUT [METHODS]] | probe [OUT]"; exit 2 ;;
esac

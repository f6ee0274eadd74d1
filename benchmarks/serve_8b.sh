#!/usr/bin/env bash
# The engine and the server under load at the Llama-3.1-8B shape on one GPU (random bfloat16 weights,
# synthetic acceptance), in three parts that each fit one 10-minute device call:
#     PYTHONPATH=. benchmarks/serve_8b.sh load OUT     # static generate AR, and the engine without speculation
#                                                      # and with EAGLE-1 at K 2, 4, 8, from 1 to 256 requests
#     PYTHONPATH=. benchmarks/serve_8b.sh mixed OUT    # no speculation and EAGLE-1 K 2, prompts prefilled
#                                                      # between visits and in the decode steps (mixed prefill),
#                                                      # static AR, transformers (METHODS=... other methods)
#     PYTHONPATH=. benchmarks/serve_8b.sh methods OUT  # transformers' continuous batching (the peer) at 64 and
#                                                      # 256 requests; the engine with EAGLE-1 K 5 tau 4 and
#                                                      # DFlash K 15 tau 6 (the figures), 1 to 256
#     PYTHONPATH=. benchmarks/serve_8b.sh http OUT     # specjax serve (HTTP, streamed) against the same engine
#                                                      # in process, EAGLE-1 K 5 tau 4 (SERVE=0: in process
#                                                      # only; INPROC=0: the server only, from the cache;
#                                                      # RUNNER=0: no engine-thread run; DETACH=1: start the
#                                                      # server and return, leaving it warming up for the next
#                                                      # call, which finds it and uses it; ENGINE_PROCESS=1:
#                                                      # the server's engine in a child process; SERVER_FLAGS=...:
#                                                      # more flags for the server; SERVER_WARMUP= : the
#                                                      # server without --warmup-prompt-len, whose measured
#                                                      # points then compile: for debugging only)
#     PYTHONPATH=. benchmarks/serve_8b.sh offload OUT  # DFlash K 15 tau 6 with draft KV offload on and off:
#                                                      # throughput, TPOT, device memory in use and peak
#     PYTHONPATH=. benchmarks/serve_8b.sh profile OUT  # the engine's host overhead from a profiler trace (EAGLE-1
#                                                      # K 5 tau 4 at 64 and 256 requests; METHODS=... for others)
#     PYTHONPATH=. benchmarks/serve_8b.sh async OUT    # async scheduling off and on, EAGLE-1 K 5 tau 4 at 1, 64,
#                                                      # 256 and 320 requests: in process, then through the
#                                                      # server's engine thread (no HTTP); STEPS=4: visits of 4
#                                                      # steps (async's refill lag is a visit: a quarter of 16's);
#                                                      # METHODS=none LOADS=256: no speculation at saturation
#     PYTHONPATH=. benchmarks/serve_8b.sh ragged OUT   # 128 to 256 new tokens a request (the range; every
#                                                      # part above gives each request 128, so they end in
#                                                      # waves), no speculation and EAGLE-1 K 5 tau 4 at 64, 256
#                                                      # and 320 requests, visits stopping after the paced
#                                                      # count of ends and at the first (--visit-ends auto,1),
#                                                      # static AR at 64 and 256 (STATIC= skips it) decoding 192;
#                                                      # MIXED=off,128x16: mixed prefill as well (requests that end
#                                                      # apart leave decode steps whose idle compute it can fill)
# BENCH_FLAGS=... adds flags to every bench_serve run of a part (e.g. "--new-tokens 192 --random-range-ratio 0.334"
# for the ragged lengths in the http part, whose server then needs SERVER_FLAGS="--max-model-len 448").
# The K sweep's tau follows one per-draft acceptance rate a = 0.835: tau(K) = (1 - a^(K+1)) / (1 - a), which
# gives tau 4.0 at K 5 (the EAGLE-1 figure the issue names) and 2.53, 3.60, 4.87 at K 2, 4, 8.
# The http part needs fastapi, uvicorn, prometheus_client and httpx; the GPU machine's image lacks the first two and
# some of their requirements, which benchmarks/device_site.sh packs for a device call (and says how to unpack).
set -uo pipefail
part=$1
out=${2:-benchmarks/results}
export PYTHONUNBUFFERED=1
common=(--models 8b --prompt-len 128 --new-tokens 128 --num-requests 8 --max-num-seqs 256 --max-prefill-batch 64
        ${BENCH_FLAGS:-})
case $part in
  load)
    python3 scripts/bench_serve.py "${common[@]}" --methods none,eagle:2:2.53,eagle:4:3.6,eagle:8:4.87 \
      --concurrency 1,16,64,256 --static-batches 64,256 --name bench_serve_8b_ksweep --output "$out"
    ;;
  mixed)
    # The engine without speculation and with EAGLE-1 K 2 (the K that still paid at 256), prompts prefilled in calls of
    # their own and in the decode steps (chunks of the whole 128-token prompt, 4 or 16 a step: one a step refilled a
    # wave of 256 one slot a step, 0.53x on 2026-12-05), against static generate AR (decoding only and with its
    # prefill) and transformers' continuous batching: the issue's 90% and 10x. MIXED=... other settings; PEER=0 skips
    # transformers, STATIC= (empty) static AR, METHODS=none the speculative engine (the whole does not fit one call).
    if [ "${PEER:-1}" != 0 ]; then
      timeout 240 python3 scripts/bench_peer_cb.py --batches 64,256 --output "$out" > "$out/bench_peer_cb.log" 2>&1
      tail -3 "$out/bench_peer_cb.log"
    fi
    python3 scripts/bench_serve.py "${common[@]}" --methods ${METHODS:-none,eagle:2:2.53} \
      --mixed-prefill ${MIXED:-off,128x4,128x16} \
      --concurrency 1,64,256 --static-batches "${STATIC-64,256}" --name bench_serve_8b_mixed --output "$out"
    ;;
  methods)
    timeout 240 python3 scripts/bench_peer_cb.py --batches 64,256 --output "$out" > "$out/bench_peer_cb.log" 2>&1
    tail -3 "$out/bench_peer_cb.log"
    python3 scripts/bench_serve.py "${common[@]}" --methods eagle:5:4,dflash:15:6 --concurrency 1,16,64,256 \
      --name bench_serve_8b_methods --output "$out"
    ;;
  http)
    # Eight requests per stream (2026-12-03: at two, a point of 64 streams lasted 2.1 s over HTTP, its first wave's
    # mean TTFT 0.4 s of it).
    common+=(--requests-per-stream ${REQUESTS_PER_STREAM:-8})
    # 320 streams on 256 slots: in process a queue is never empty and a slot that frees is refilled at once; over HTTP
    # a replacement comes a client round trip after its request ended, and one that misses the visit's start waits
    # the visit out (docs/performance.md, the stand-in's reproduction). RATES=120: open-loop Poisson arrivals at
    # those rates instead (requests/s; 120 is above this workload's ~105 a second), where both paths keep a queue.
    loads=${LOADS:-1,64,256,320}
    load_flags=(--concurrency $loads)
    [ -z "${RATES:-}" ] || load_flags=(--rate $RATES)
    # In process first: its programs fill the compile cache the server's warm-up then reads (on 2026-12-03 the
    # server's own warm-up of greedy and sampled programs outlasted a 240 s wait and no request was served).
    export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/specjax_serve_8b_cache}
    # INPROC=0 skips it (a second device call after the first filled the cache: each call has 10 minutes).
    if [ "${INPROC:-1}" != 0 ]; then
      python3 scripts/bench_serve.py "${common[@]}" --methods eagle:5:4 "${load_flags[@]}" \
        --name bench_serve_8b_inproc --output "$out"
      # The same through the server's engine thread, no HTTP: which part of HTTP's loss is the thread's scheduling
      # (RUNNER=0 skips it).
      [ "${RUNNER:-1}" = 0 ] || python3 scripts/bench_serve.py "${common[@]}" --methods eagle:5:4 "${load_flags[@]}" \
        --through runner --name bench_serve_8b_runner --output "$out"
      [ "${SERVE:-1}" != 0 ] || exit 0
    fi
    # The clients send greedy requests only: the warm-up leaves the sampled programs out (116 s of it at this shape).
    # A server still running (one a call with DETACH=1 left, warming up or up) is used as it is: a second
    # device call then pays no second warm-up. Its log is in /tmp (a call's OUT goes when the call ends); the
    # stats and access lines of the measured points are copied into OUT at the end.
    log=/tmp/serve_8b.log
    server=$(pgrep -f "^python3 -m specjax.cli serve" | head -1)  # anchored: not a shell whose command names it
    if [ -n "$server" ]; then
      echo "using the server already running (pid $server)"
    else
      setsid python3 -m specjax.cli serve --model shape:8b --method eagle --num-speculative-tokens 5 \
        --set spec.rejection_sample_method=synthetic --set spec.synthetic_acceptance_length=4 \
        --max-num-seqs 256 --max-model-len 320 --max-prefill-batch 64 ${SERVER_WARMUP---warmup-prompt-len 128} \
        --no-warmup-sampled \
        --port 8765 --per-request-spec-decode-metrics summary --log-stats-interval 2 \
        --profile-dir /tmp/specjax_serve_8b_profile ${ENGINE_PROCESS:+--engine-process} ${SERVER_FLAGS:-} \
        > $log 2>&1 < /dev/null &
      server=$!
    fi
    [ "${DETACH:-0}" = 0 ] || { echo "server $server left warming up for the next call"; exit 0; }
    for _ in $(seq ${HEALTH_WAIT_S:-420}); do
      curl -sf localhost:8765/health > /dev/null && break
      kill -0 $server 2> /dev/null || { echo "the server exited:"; tail -20 $log; exit 1; }
      sleep 1
    done
    curl -sf localhost:8765/health > /dev/null || { echo "the server is not up after the wait"; tail -5 $log; kill -TERM $server; exit 1; }
    grep -n "warm-up\|ready\|Uvicorn running" $log | tail -8
    start_line=$(wc -l < $log)
    # The client on the CPU: the GPU belongs to the server.
    # One client process, then four sharing the load (one Python event loop parsing 256 streams may be the bound).
    for processes in ${CLIENT_PROCESSES:-1 4}; do
      JAX_PLATFORMS=cpu python3 scripts/bench_serve.py --url http://127.0.0.1:8765 "${common[@]}" --methods eagle:5:4 \
        "${load_flags[@]}" --client-processes $processes \
        --name bench_serve_8b_http$([ "$processes" = 1 ] || echo "_p$processes") --output "$out"
    done
    # Then the last load again under the profiler (/start_profile, /stop_profile): the device's busy share and idle
    # time a step in the server, against the in-process figures of `serve_8b.sh profile` (PROFILE=0 skips it).
    if [ "${PROFILE:-1}" != 0 ]; then
      curl -sf -X POST localhost:8765/start_profile && \
        JAX_PLATFORMS=cpu python3 scripts/bench_serve.py --url http://127.0.0.1:8765 "${common[@]}" --methods eagle:5:4 \
          --concurrency ${loads##*,} --requests-per-stream 2 --client-processes ${CLIENT_PROCESSES:-4} \
          --name bench_serve_8b_http_profiled --output "$out"
      curl -sf -X POST localhost:8765/stop_profile > "$out/serve_8b_http_profile.json"; cat "$out/serve_8b_http_profile.json"
    fi
    # The stats lines (one every 2 s) without the access lines (one a request: thousands).
    tail -n +$((start_line + 1)) $log | grep -v "prompt_tokens=\|POST /v1" > "$out/serve_8b_stats.txt"
    kill -TERM $server; while kill -0 $server 2> /dev/null; do sleep 1; done
    ;;
  offload)
    for offload in on off; do  # one setting a process: the device memory peak JAX reports never goes down
      python3 scripts/bench_serve.py "${common[@]}" --methods dflash:15:6 --concurrency 1,64,256 \
        --draft-kv-offload $offload --name bench_serve_8b_offload_$offload --output "$out"
    done
    ;;
  profile)
    # Two requests per stream: the first wave's prefill and the replacements' both in the trace. The traces stay
    # on the machine (too deep and too large for OUT); the table has what they say.
    export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/specjax_serve_8b_cache}
    python3 scripts/bench_serve.py "${common[@]}" --methods ${METHODS:-eagle:5:4} --concurrency 64,256 \
      --requests-per-stream 2 --profile /tmp/specjax_serve_8b_profile --name bench_serve_8b_profile --output "$out"
    ;;
  async)
    common+=(--requests-per-stream ${REQUESTS_PER_STREAM:-8})
    export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/specjax_serve_8b_cache}
    for through in engine runner; do
      python3 scripts/bench_serve.py "${common[@]}" --methods ${METHODS:-eagle:5:4} --concurrency ${LOADS:-1,64,256,320} \
        --through $through --async-scheduling off,on --steps-per-visit ${STEPS:-16} \
        --name bench_serve_8b_async_${through}_s${STEPS:-16} --output "$out"
    done
    ;;
  ragged)
    export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/specjax_serve_8b_cache}
    python3 scripts/bench_serve.py "${common[@]}" --new-tokens 192 --random-range-ratio 0.334 \
      --requests-per-stream ${REQUESTS_PER_STREAM:-4} --methods ${METHODS:-none,eagle:5:4} \
      --concurrency ${LOADS:-64,256,320} --visit-ends ${VISIT_ENDS:-auto,1} --static-batches "${STATIC-64,256}" \
      --mixed-prefill ${MIXED:-off} --name bench_serve_8b_ragged --output "$out"
    ;;
  *) echo "usage: $0 load|mixed|methods|http|offload|profile|async|ragged [OUT]"; exit 2 ;;
esac

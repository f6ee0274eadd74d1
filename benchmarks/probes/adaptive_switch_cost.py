"""What the switch costs and what a narrower forward saves (DFlash K 7, or METHOD's; synthetic acceptance, bf16).

    PYTHONPATH=. python benchmarks/probes/adaptive_switch_cost.py [SHAPE [BATCHES [METHOD]]]   # tiny 1,64 dflash
    XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL ...   # the switch inside CUDA-graph command buffers"""
import dataclasses, sys
import jax, jax.numpy as jnp, numpy as np
from specjax import benchmarking
from specjax.speed import build_target, build_drafter, generation_args, speculative_run, synthetic_spec, tokens_per_s, cache_size_for
from specjax.metrics import AcceptanceMetrics
shape = sys.argv[1] if len(sys.argv) > 1 else "tiny"
tc, dc = benchmarking.SHAPES[shape]
method = sys.argv[3] if len(sys.argv) > 3 else "dflash"
target = build_target(tc); drafter = build_drafter(method, tc, dc)
K, rates = 7, (0.8, 0.65, 0.5, 0.4, 0.3, 0.2, 0.15)
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 64]
for batch in batches:
    cache = cache_size_for(16, 64, K)
    run_args = generation_args(target, batch, 16, 64, K + 1, cache)
    one_args = generation_args(target, batch, 16, 1, K + 1, cache)
    fixed = synthetic_spec(method, 0, K, rates=rates)
    switched = dataclasses.replace(fixed, enable_adaptive_verification=True, adaptive_verify_widths=(0, 1, 2, 4, 7))
    cases = {"fixed K7": (fixed, None),
             "adaptive widths (7,) [mask: no switch]": (dataclasses.replace(fixed, enable_adaptive_verification=True, adaptive_verify_widths=(7,)), jnp.ones(1)),
             "adaptive switch forced 7": (switched, jnp.asarray([10., 10, 10, 10, 1])),
             "adaptive switch forced 4": (switched, jnp.asarray([10., 10, 10, 1, 10])),
             "adaptive switch forced 2": (switched, jnp.asarray([10., 10, 1, 10, 10])),
             "fixed K4": (synthetic_spec(method, 0, 4, rates=rates), None),
             "fixed K2": (synthetic_spec(method, 0, 2, rates=rates), None)}
    for name, (spec, costs) in cases.items():
        tok_s, _ = tokens_per_s(speculative_run(target, drafter, spec, cache, verify_costs=costs), run_args, one_args)
        state = speculative_run(target, drafter, spec, cache, final_state=True, verify_costs=costs)(run_args)
        m = AcceptanceMetrics.from_counters(state.counters, batch)
        print(f"B={batch} {name}: {tok_s:.0f} tok/s, mean width {m.drafted.sum() / m.steps.sum():.2f}, tau {m.summary()['mean_acceptance_length']:.2f}", flush=True)

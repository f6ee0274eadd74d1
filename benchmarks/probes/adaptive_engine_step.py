"""Why the adaptive engine's step costs more than the fixed engine's, where `generate`'s does not.

On the H100 at the 8B shape the adaptive engine stepped 1.8 ms above its own profiled cost curve at 1 and 16
requests (docs/performance.md, twentieth session), the fixed engines within 3% of it. This probe builds both
engines as bench-serve does (DFlash K, synthetic acceptance, `--slots` slots, one request), and for each prints:

- ms a step of the engine's own visits (one request served to its budget, the first visit, which compiles, left
  out), split into the time the host spends in the call and the rest (the device's, and the summary's read);
- the compiled visit program over the stepped slots (`Engine.step_hlo`): its conditionals and while loops,
  command buffers (a GPU's CUDA graphs), kernel-like operations in the step and in the adaptive switch's widest
  branch, and copies of a MiB or more outside fusions;
- for the adaptive engine, the same counts for the loop its cost curve is profiled through
  (`decoding.step_profile_loop`), whose step measured within 3% of `generate`'s.

    PYTHONPATH=. python benchmarks/probes/adaptive_engine_step.py [--shape tiny|8b] [--k 15] [--slots 16] \
        [--only fixed|adaptive]
    XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL ...   # a conditional's index kept on the device
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 ... --only adaptive 2>&1 | grep -c "Update command"

The last counts the CUDA graphs XLA re-records because the buffers they use moved (it logs each, with the
executions since the one before). Against the steps and visits printed, the count says whether the adaptive
engine pays that once a visit (a cost the profile's and `generate`'s timings cancel: each is a difference of two
runs) or every step, or not at all. The engines take an analytic cost curve, so nothing is profiled: the curve is
data, the programs the same.
"""

from __future__ import annotations

import argparse
import re

import jax
import numpy as np

from specjax import adaptive, benchmarking
from specjax.decoding import step_profile_loop
from specjax.engine import Engine, EngineConfig, Request
from specjax.proposers import build_proposer
from specjax.speed import build_drafter, build_target, synthetic_spec
from specjax.verify.sampling import GREEDY

from benchmarks.probes.adaptive_step_kernels import KERNEL, computations

RATES = (0.691, 0.454, 0.327, 0.240, 0.182, 0.138, 0.116, 0.102, 0.082, 0.069, 0.061, 0.055, 0.050, 0.044, 0.041)
COPY = re.compile(r"= (\w+)\[([\d,]*)\]\S* copy\(")
BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2}


def structure(text: str) -> dict:
    """Counts of what the compiled program runs (see the module's docstring)."""
    found = computations(text)
    loops = {m.group(1) for m in re.finditer(r"while\(.*?body=%?([\w.\-]+)", text)}
    body = max(loops, key=lambda b: len(KERNEL.findall("\n".join(found.get(b, [])))), default=None)
    branches = []
    for line in found.get(body, []):
        names = re.search(r"conditional\(.*?branch_computations=\{([^}]*)\}", line)
        if names:
            branches = [len(KERNEL.findall("\n".join(found.get(n.strip().lstrip("%"), []))))
                        for n in names.group(1).split(",")]
    big = 0
    for name, lines in found.items():
        for line in lines if not name.startswith("fused") else ():
            match = COPY.search(line)
            if match:
                size = int(np.prod([int(d) for d in match.group(2).split(",") if d] or [1]))
                big += size * BYTES.get(match.group(1), 4) >= 2**20
    return {"conditionals": text.count(" conditional("), "while loops": len(loops),
            "command buffers": len(re.findall(r"command_buffer", text)),
            "step kernels": len(KERNEL.findall("\n".join(found.get(body, [])))),
            "branch kernels": branches, "copies >= 1 MiB": big}


def visit_times(engine: Engine, prompt: list[int], budget: int) -> dict:
    """One request served to its budget, visit by visit; the first visit (which compiles) left out. Device: the
    engine's wait for each visit's call and its summary (Engine.device_wait_s); host: the rest of its step_s."""
    engine.add_request(Request.make("probe", prompt, budget))
    engine.step()
    steps, visits, step_s, device_s = engine.steps_run, engine.visits, engine.step_s, engine.device_wait_s
    while engine.has_work():
        engine.step()
    steps, device_s, step_s = engine.steps_run - steps, engine.device_wait_s - device_s, engine.step_s - step_s
    if not steps:
        raise SystemExit(f"the request's {budget} tokens took one visit, which compiles: allowed --new-tokens past "
                         "what one visit emits (a few hundred)")
    return {"steps": steps, "visits": engine.visits - visits,
            "device ms a step": round(1e3 * device_s / max(steps, 1), 3),
            "host ms a step": round(1e3 * (step_s - device_s) / max(steps, 1), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(benchmarking.SHAPES), default="tiny")
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--only", choices=("fixed", "adaptive"), default=None, help="one engine (default both)")
    args = parser.parse_args()
    target_config, draft_config = benchmarking.SHAPES[args.shape]
    target = build_target(target_config)
    drafter = build_drafter("dflash", target_config, draft_config)
    prompt = np.random.default_rng(0).integers(0, target_config.vocab_size, args.prompt_len).tolist()
    cache = -(-(args.prompt_len + args.new_tokens + args.k + 1) // 64) * 64  # bench-serve's max_model_len
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, {args.shape}, DFlash K {args.k}, "
          f"{args.slots} slots, one request stepped (count 1)", flush=True)
    for adaptive_on in [name == "adaptive" for name in ((args.only,) if args.only else ("fixed", "adaptive"))]:
        spec = synthetic_spec("dflash", 0, args.k, rates=RATES[:args.k], adaptive=adaptive_on)
        curve = adaptive.CostCurve.analytic((1,), spec.verify_widths) if adaptive_on else None
        config = EngineConfig(max_num_seqs=args.slots, max_model_len=cache, spec=spec, max_prefill_batch=1,
                              step_slot_counts=(1, args.slots) if args.slots > 1 else None, cost_curve=curve)
        engine = Engine(target, config, drafter=drafter)
        name = "adaptive" if adaptive_on else "fixed"
        print(f"{name} engine: {visit_times(engine, prompt, args.new_tokens)}", flush=True)
        print(f"{name} engine's visit program: {structure(engine.step_hlo(1))}", flush=True)
        if adaptive_on:  # the engine's proposer, as its program builds it for greedy rows
            proposer = build_proposer(spec, GREEDY, cache, drafter)
            _, program, arguments = step_profile_loop(target, proposer.bind(drafter, target), proposer, 1)
            forced = adaptive.forced_costs(spec.verify_widths, len(spec.verify_widths) - 1)
            text = program.lower(np.int32(2), *arguments(forced)).compile().as_text()
            print(f"the loop its curve is profiled through: {structure(text)}", flush=True)


if __name__ == "__main__":
    main()

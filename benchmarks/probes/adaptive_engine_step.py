"""Why the adaptive engine's step costs more than the fixed engine's, where `generate`'s does not.

On the H100 at the 8B shape the adaptive engine stepped 1.8 ms above its own profiled cost curve at 1 and 16
requests (docs/performance.md, twentieth session), the fixed engines within 3% of it. This probe builds both
engines as bench-serve does (DFlash K, synthetic acceptance, `--slots` slots, one request at a time), and for each
prints:

- ms a step of the engine's own visits (two requests served to their budgets in turn, the visits that compile a
  step program left out), split into the time the host spends in the call and the rest (the device's, and the
  summary's read), each visit's device ms a step, and the steps of held visits (EngineConfig.
  adaptive_held_visits: the adaptive engine's visits with no switch while it chooses the last visit's width);
- the compiled visit program over the stepped slots (`Engine.step_hlo`): its conditionals and while loops,
  command buffers (a GPU's CUDA graphs), kernel-like operations in the step and in the adaptive switch's widest
  branch, and copies of a MiB or more outside fusions;
- for the adaptive engine, the same counts for the loop its cost curve is profiled through
  (`decoding.step_profile_loop`), whose step measured within 3% of `generate`'s.

    PYTHONPATH=. python benchmarks/probes/adaptive_engine_step.py [--shape tiny|8b] [--k 15] [--slots 16] \
        [--only fixed|adaptive] [--each-visit] [--no-held-visits]
    XLA_FLAGS=--xla_gpu_enable_command_buffer= ...   # no CUDA graphs (the twenty-second session's finding)
    XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL ...   # a conditional's index kept on the device
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 ... --only adaptive 2>&1 | grep -c "Update command"
    ... --trace DIR   # then one more request traced (DIR/fixed, DIR/adaptive): where the device's time goes

The last counts the CUDA graphs XLA re-records because the buffers they use moved (it logs each, with the
executions since the one before). Against the steps and visits printed, the count says whether the adaptive
engine pays that once a visit (a cost the profile's and `generate`'s timings cancel: each is a difference of two
runs) or every step, or not at all. The engines take an analytic cost curve, so nothing is profiled: the curve is
data, the programs the same.

With --trace, each engine serves one more request of --new-tokens under JAX's profiler (everything it runs is
compiled by then) and the probe prints the device's busy and idle ms a step, the idle gaps of 50 us or more a step
with the kernels either side of the ones that cost most, and, with both engines, the kernel names whose time a
step differs most between them.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re

import jax
import numpy as np

from specjax import adaptive, benchmarking, profiling
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


def visit_times(engine: Engine, prompt: list[int], budget: int, requests: int = 2, each: bool = False) -> dict:
    """`requests` requests served to their budget one after another, visit by visit; the visits that compiled a
    step program (the first; with held visits the first held one too) left out. Device: the engine's wait for
    each visit's call and its summary (Engine.device_wait_s); host: the rest of its step_s. Each visit's device ms a
    step too, a request's visits in a list: whether an excess is paid once (the first visits only), once a request
    (each request's first visits) or every visit; the steps of held visits (EngineConfig.adaptive_held_visits);
    and each request's verified widths (steps at each), so that a difference in time is not one of widths. each:
    print every visit's steps and ms as it lands (between any compile logs: JAX_LOG_COMPILES=1)."""
    steps = visits = held = 0
    step_s = device_s = 0.0
    per_visit, widths = [], []
    for index in range(requests):
        engine.add_request(Request.make(f"probe{index}", prompt, budget))
        visit_ms = []
        while engine.has_work():
            before = engine.steps_run, engine.device_wait_s, engine.step_s, engine.held_steps
            compiled = sum(engine.step_programs().values())
            for output in engine.step():
                drafted = (output.metrics or {}).get("per_step_drafted") or ()
                widths.append(dict(sorted(collections.Counter(int(w) for w in drafted).items())))
            if sum(engine.step_programs().values()) > compiled:
                continue
            ran, holding = engine.steps_run - before[0], engine.held_steps - before[3]
            steps, visits, held = steps + ran, visits + 1, held + holding
            device_s += engine.device_wait_s - before[1]
            step_s += engine.step_s - before[2]
            visit_ms.append(round(1e3 * (engine.device_wait_s - before[1]) / max(ran, 1), 2))
            if each:
                print(f"  request {index}, visit {len(visit_ms)}: {ran} steps{' (held)' if holding else ''}, "
                      f"{visit_ms[-1]} device ms a step", flush=True)
        per_visit.append(visit_ms)
    if not steps:
        raise SystemExit(f"the request's {budget} tokens took one visit, which compiles: allowed --new-tokens past "
                         "what one visit emits (a few hundred)")
    return {"steps": steps, "visits": visits, "held visits' steps": held,
            "device ms a step": round(1e3 * device_s / steps, 3),
            "host ms a step": round(1e3 * (step_s - device_s) / steps, 3),
            "device ms a step, each visit": per_visit, "verified widths (steps)": widths}


def traced(engine: Engine, prompt: list[int], budget: int, log_dir: str) -> dict:
    """One more request served under the profiler; its steps and the trace's kernels (name, start, end in us)."""
    steps = engine.steps_run
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        engine.add_request(Request.make("traced", prompt, budget))
        while engine.has_work():
            engine.step()
    with gzip.open(profiling.trace_file(log_dir), "rt") as handle:
        events = json.load(handle)
    events = events["traceEvents"] if isinstance(events, dict) else events
    threads = profiling.kernel_threads(events)
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), str(e.get("name", "")))
                     for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in threads)
    return {"steps": engine.steps_run - steps, "kernels": kernels}


def trace_report(name: str, run: dict, gap_us: float = 50.0) -> dict[str, float]:
    """Prints busy and idle ms a step and the costliest gaps by the kernels either side; returns ms a step by name."""
    steps, kernels = run["steps"], run["kernels"]
    if not kernels:
        print(f"{name} engine traced: {steps} steps, no device kernels in the trace (a CPU run)")
        return collections.Counter()
    timeline = profiling.device_timeline([(start, end) for start, end, _ in kernels])
    gaps, end_before, name_before = collections.Counter(), kernels[0][1], kernels[0][2]
    for start, end, kernel in kernels[1:]:
        if start - end_before >= gap_us:
            gaps[(name_before[:60], kernel[:60])] += (start - end_before) / 1e3
        if end >= end_before:
            end_before, name_before = end, kernel
    print(f"{name} engine traced: {steps} steps, {len(kernels) / steps:.1f} kernels, busy "
          f"{timeline['busy_ms'] / steps:.3f} ms and idle {timeline['idle_ms'] / steps:.3f} ms a step, of which "
          f"gaps of {gap_us:.0f} us or more {sum(gaps.values()) / steps:.3f} ms", flush=True)
    for (before, after), ms in gaps.most_common(8):
        print(f"  {ms / steps:.3f} ms a step idle between {before} and {after}")
    by_name = collections.Counter()
    for start, end, kernel in kernels:
        by_name[kernel] += (end - start) / 1e3 / steps
    return by_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(benchmarking.SHAPES), default="tiny")
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--only", choices=("fixed", "adaptive"), default=None, help="one engine (default both)")
    parser.add_argument("--each-visit", action="store_true", help="print each visit as it lands")
    parser.add_argument("--no-held-visits", action="store_true",
                        help="the adaptive engine without held visits (EngineConfig.adaptive_held_visits)")
    parser.add_argument("--trace", default=None, help="trace one more request of each engine under this folder")
    args = parser.parse_args()
    target_config, draft_config = benchmarking.SHAPES[args.shape]
    target = build_target(target_config)
    drafter = build_drafter("dflash", target_config, draft_config)
    prompt = np.random.default_rng(0).integers(0, target_config.vocab_size, args.prompt_len).tolist()
    cache = -(-(args.prompt_len + args.new_tokens + args.k + 1) // 64) * 64  # bench-serve's max_model_len
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, {args.shape}, DFlash K {args.k}, "
          f"{args.slots} slots, one request stepped (count 1)", flush=True)
    times: dict[str, collections.Counter] = {}
    for adaptive_on in [name == "adaptive" for name in ((args.only,) if args.only else ("fixed", "adaptive"))]:
        spec = synthetic_spec("dflash", 0, args.k, rates=RATES[:args.k], adaptive=adaptive_on)
        curve = adaptive.CostCurve.analytic((1,), spec.verify_widths) if adaptive_on else None
        config = EngineConfig(max_num_seqs=args.slots, max_model_len=cache, spec=spec, max_prefill_batch=1,
                              step_slot_counts=(1, args.slots) if args.slots > 1 else None, cost_curve=curve,
                              adaptive_held_visits=not args.no_held_visits)
        engine = Engine(target, config, drafter=drafter)
        name = "adaptive" if adaptive_on else "fixed"
        print(f"{name} engine: {visit_times(engine, prompt, args.new_tokens, each=args.each_visit)}", flush=True)
        print(f"{name} engine's visit program: {structure(engine.step_hlo(1))}", flush=True)
        if args.trace:
            times[name] = trace_report(name, traced(engine, prompt, args.new_tokens, f"{args.trace}/{name}"))
            continue
        if adaptive_on:  # the engine's proposer, as its program builds it for greedy rows
            proposer = build_proposer(spec, GREEDY, cache, drafter)
            _, program, arguments = step_profile_loop(target, proposer.bind(drafter, target), proposer, 1)
            forced = adaptive.forced_costs(spec.verify_widths, len(spec.verify_widths) - 1)
            text = program.lower(np.int32(2), *arguments(forced)).compile().as_text()
            print(f"the loop its curve is profiled through: {structure(text)}", flush=True)

    if len(times) == 2:  # what the adaptive step runs that the fixed one does not, by kernel name
        names = set(times["fixed"]) | set(times["adaptive"])
        for kernel in sorted(names, key=lambda k: -abs(times["adaptive"][k] - times["fixed"][k]))[:15]:
            more = times["adaptive"][kernel] - times["fixed"][kernel]
            print(f"  {more:+.3f} ms a step (adaptive - fixed) {kernel[:100]}")


if __name__ == "__main__":
    main()

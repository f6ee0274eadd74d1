"""A/B of the real decode loop's step between code trees and XLA options, one process per configuration.

    mkdir -p ab/main && git archive main $(git ls-files 'specjax/*.py' 'benchmarks/*.py') | tar -x -C ab/main
    python -m benchmarks.probes.ab_decode_loop --trees .,ab/main --batches 1,16,64 \
        [--xla-flags '|--xla_gpu_enable_pdl=true'] [--reverse] [--name decode_loop_ab]

A tree is a directory holding a `specjax` package and its `benchmarks` (the working tree, or another
revision exported as above: on the device machine there is no git, so export before the run; revisions
from before the probes moved to benchmarks/probes kept them in scripts/ and do not run here). Each
(tree, XLA_FLAGS) configuration runs in a fresh process, so the model is built, compiled and
autotuned afresh, as a user's run would be. It times `profile_decode.decode_loop_step` (a 256-token
greedy run minus a one-token run, bench_decode's way) at each batch, then the first batch again to
show drift, against the floor (weights + KV bytes over the highest copy bandwidth that process measured,
before the first batch and after each; the lowest is reported beside it).
The configurations run in the order given, or reversed with --reverse: on two GPUs, run once per
GPU (CUDA_VISIBLE_DEVICES) in opposite orders, so that drift and GPU differences show. Compare the
step times: the copy bandwidth varies by a few percent from process to process, and "of floor" with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# Run in each configuration's process, from its tree.
WORKER = """
import json, sys
from benchmarks.probes.profile_decode import decode_loop_step
from specjax import benchmarking
from specjax.benchmarking import SHAPES, kv_bytes, on_device, weight_bytes
from specjax.models.transformer import init_model, to_decoding_layout

shape, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
config, _ = SHAPES[shape]
model = to_decoding_layout(on_device(lambda: init_model(config, seed=0)))
bandwidths, steps = [benchmarking.copy_bandwidth()], []
for batch in batches + batches[:1]:
    steps.append(decode_loop_step(model, batch))
    bandwidths.append(benchmarking.copy_bandwidth())
bandwidth = max(bandwidths)
for position, (batch, step) in enumerate(zip(batches + batches[:1], steps)):
    floor = (weight_bytes(model, config, batch) + kv_bytes(config, batch, 256)) / bandwidth
    print("AB_ROW " + json.dumps({"B": batch, "repeat": position >= len(batches), "step_ms": step * 1e3,
                                  "floor_ms": floor * 1e3, "of_floor": floor / step, "copy_TBps": bandwidth / 1e12,
                                  "copy_min_TBps": min(bandwidths) / 1e12}), flush=True)
"""


def run_configuration(tree: str, xla_flags: str, shape: str, batches: str) -> list[dict]:
    """The rows one configuration's process prints (none if it fails: its output is shown instead)."""
    path = os.path.abspath(tree)
    env = {**os.environ, "PYTHONPATH": path, "XLA_FLAGS": xla_flags}
    result = subprocess.run([sys.executable, "-c", WORKER, shape, batches], cwd=path, env=env,
                            capture_output=True, text=True)
    rows = [json.loads(line[len("AB_ROW "):]) for line in result.stdout.splitlines() if line.startswith("AB_ROW ")]
    if result.returncode != 0:
        print(f"{tree} with XLA_FLAGS={xla_flags!r} failed (exit {result.returncode}):\n{result.stderr[-3000:]}",
              flush=True)
    return [{"tree": tree, "xla_flags": xla_flags, **row} for row in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", default=".", help="comma-separated directories, each with specjax/ and benchmarks/")
    parser.add_argument("--xla-flags", default="",
                        help="XLA_FLAGS values to run each tree under, separated by '|' ('' is XLA's defaults)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--shape", default="8b", help="a specjax.benchmarking.SHAPES name")
    parser.add_argument("--reverse", action="store_true", help="run the configurations in reverse order")
    parser.add_argument("--name", default="decode_loop_ab")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "benchmarks/results/probes"))
    args = parser.parse_args()
    trees = args.trees.split(",")
    for tree in trees:
        if not all(os.path.isdir(os.path.join(tree, part)) for part in ("specjax", "benchmarks/probes")):
            parser.error(f"--trees entry {tree!r} has no specjax/ and benchmarks/probes/: "
                         "allowed directories holding both")
    configurations = [(tree, flags.strip()) for tree in trees for flags in args.xla_flags.split("|")]
    rows = []
    for order, (tree, flags) in enumerate(configurations[::-1] if args.reverse else configurations):
        for row in run_configuration(tree, flags, args.shape, args.batches):
            rows.append({"order": order, **row})
            print(rows[-1], flush=True)

    from specjax import benchmarking

    meta = {**benchmarking.environment(), "shape": args.shape, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "prompt": 128, "new_tokens": 256, "cache": 512}
    columns = [("order", "order"), ("tree", "tree"), ("xla_flags", "XLA_FLAGS"), ("B", "B"), ("repeat", "repeat"),
               ("step_ms", "step ms"), ("floor_ms", "floor ms"), ("of_floor", "of floor"), ("copy_TBps", "copy TB/s"),
               ("copy_min_TBps", "lowest copy TB/s")]
    paths = benchmarking.write_results(args.name, rows, columns, meta, args.out_dir,
                                       notes="Written by benchmarks/probes/ab_decode_loop.py; see its docstring for the method.")
    print("wrote", *paths)


if __name__ == "__main__":
    main()

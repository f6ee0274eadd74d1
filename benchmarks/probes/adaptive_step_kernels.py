"""How many more kernels an adaptive step launches than a fixed-K step, counted in the compiled loop.

At batch 1 on the H100 the adaptive loop (widths 0 and 15 worth choosing, so 15 every step) stepped 0.30 ms slower
than the fixed K 15 loop (docs/performance.md, nineteenth session). This probe compiles both loops (DFlash K 15, batch 1, synthetic
acceptance; the tiny shape by default) and counts the kernel-like operations (fusions, copies, scatters,
gathers, sorts, custom calls) a step runs: the loop body's own, plus the width-K branch of the adaptive step's
conditional. XLA:CPU fuses differently from XLA:GPU, so on the CPU the counts point at what to measure on a device,
no more; on a GPU, --shape 8b counts what it runs.

    PYTHONPATH=. python benchmarks/probes/adaptive_step_kernels.py [--shape tiny|8b] [--k 15] [--detail]

--detail lists the adaptive loop body's operations by the JAX operation that made them.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from specjax import benchmarking
from specjax.decoding import speculative_loop
from specjax.proposers import build_proposer
from specjax.speed import build_drafter, build_target, cache_size_for, generation_args, synthetic_spec
from specjax.verify.sampling import SamplingMode

KERNEL = re.compile(r"=\s*\S+\s+(fusion|copy|scatter|gather|sort|custom-call)\(")


def computations(text: str) -> dict[str, list[str]]:
    """The compiled HLO module's computations by name, each its instruction lines."""
    found, lines = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            lines = found.setdefault(head.group(1), [])
        elif lines is not None:
            lines.append(line)
    return found


def step_kernels(text: str) -> tuple[Counter, list[int], list[str]]:
    """(the decoding loop body's kernel-like operations by kind, each conditional branch's count, the body's
    lines). The decoding loop is the while loop whose body holds the most of them (the others are the layer scans
    and the like)."""
    found = computations(text)
    bodies = set(re.findall(r"while\(.*?body=%?([\w.\-]+)", text))
    counts = {body: Counter(KERNEL.findall("\n".join(found.get(body, [])))) for body in bodies}
    body = max(counts, key=lambda b: sum(counts[b].values()))
    branches = []
    for names in re.findall(r"conditional\(.*?branch_computations=\{([^}]*)\}", "\n".join(found[body])):
        branches = [len(KERNEL.findall("\n".join(found.get(n.strip().lstrip("%"), [])))) for n in names.split(",")]
    return counts[body], branches, found[body]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(benchmarking.SHAPES), default="tiny")
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--detail", action="store_true")
    args = parser.parse_args()
    k = args.k
    target_config, draft_config = benchmarking.SHAPES[args.shape]
    target = build_target(target_config)
    drafter = build_drafter("dflash", target_config, draft_config)
    cache = cache_size_for(16, 32, k)
    run_args = generation_args(target, 1, 16, 32, k + 1, cache)
    fixed = synthetic_spec("dflash", 0, k, rates=tuple(np.linspace(0.7, 0.05, k)))
    adaptive = dataclasses.replace(fixed, enable_adaptive_verification=True, adaptive_verify_widths=(0, k))

    def compiled(spec, costs) -> str:
        proposer = build_proposer(spec, SamplingMode(), cache, drafter)
        bound = proposer.bind(drafter, target)
        loop = jax.jit(lambda a, c: speculative_loop(target, bound, *a, verify_costs=c, proposer=proposer,
                                                     eos_token_ids=()))
        return loop.lower(run_args, costs).compile().as_text()

    for name, spec, costs in (("fixed K", fixed, None),
                              ("adaptive, widths (0, K)", adaptive, jnp.asarray([1.0, 1.2], jnp.float32))):
        body, branches, lines = step_kernels(compiled(spec, costs))
        at_k = sum(body.values()) + (branches[-1] if branches else 0)
        print(f"{name}: {at_k} kernel-like operations a step at width {k} (loop body {dict(sorted(body.items()))}"
              + (f"; its conditional's branches {branches}" if branches else "") + ")")
        if args.detail and branches:
            for line in lines:
                kind = KERNEL.search(line)
                if kind:
                    made_by = re.search(r'op_name="([^"]+)"', line)
                    print(f"  {kind.group(1)}: {made_by.group(1).split('/body/')[-1] if made_by else '?'}")


if __name__ == "__main__":
    main()

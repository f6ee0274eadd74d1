"""What does one small kernel cost inside a decode step? Chains of 32 dependent calls, timed on the GPU.

    python -m benchmarks.probes.kernel_chain_latency [--batch 1] [--context 384] [--only REGEX] [--name NAME]

At batch 1 an 8B-shaped decode step runs about 15 kernels a layer, eleven of them tiny; the step's gap
to the memory floor is their cost. Each variant here is one link of a chain run 32 times (once a layer)
with every link reading the previous link's output and an optimization barrier between links, so XLA
neither fuses links nor overlaps them, timed inside a jitted loop (benchmarking.time_in_loop: XLA
puts the loop body's kernels into command buffers, as in the decode loop). Reported: microseconds a
link.
- barrier: the barrier alone (what the chain itself costs);
- xla_scale: one elementwise XLA fusion on the [B, 1, H, E] queries;
- xla_rms_norm: transformer.normalize on a [B, 1, D] hidden state (XLA: a reduction and a multiply);
- pallas_copy: a Pallas (Triton) kernel with decode_attention's grid and blocks that copies the
  queries' rows (what any Pallas call on that grid costs before it does work);
- pallas_copy_one_program: the same copy in one program;
- mosaic_copy, mosaic_copy_one_program: the same copy over 8 programs or one as a Mosaic GPU kernel,
  the backend JAX recommends now that it deprecates the Triton lowering (GPUs only);
- attention: pallas_kernels.decode_attention as the model calls it (the layout fusion, the kernel with
  its cache write, the combine of the splits), with `context` filled slots of a 512-slot cache;
- attention_splits_N: the same with N slot splits (1: no combine).
Results: benchmarks/results/probes/kernel_chain_latency*.md; run from copies of the tree that change
the kernel (cd copy && python -m benchmarks.probes.kernel_chain_latency), decode_attention_parts.md.
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from specjax import benchmarking
from specjax.benchmarking import SHAPES
from specjax.models.transformer import normalize
from specjax.pallas_kernels import decode_attention as attention_kernel

LINKS = 32


def chain(link):
    """link(x, i) -> x, 32 times, with a barrier between links."""
    def run(x, *state):
        for i in range(LINKS):
            x, *state = link(x, i, *state)
            x, *state = jax.lax.optimization_barrier((x, *state))
        return x, (x, *state)
    return run


def pallas_copy(q, num_programs: int, interpret: bool):
    """q [B, 1, H, E] -> the same, through a Pallas kernel (Triton, as specjax's kernels are) over
    `num_programs` programs of rows."""
    rows = q.reshape(num_programs, -1)  # a row a program

    def kernel(in_ref, out_ref):
        out_ref[...] = in_ref[...]

    spec = pl.BlockSpec((1, rows.shape[1]), lambda i: (i, 0))
    out = pl.pallas_call(kernel, grid=(num_programs,), in_specs=[spec], out_specs=spec,
                         out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype), interpret=interpret)(rows)
    return out.reshape(q.shape)


def mosaic_copy(q, num_programs: int):
    """The same copy as a Mosaic GPU kernel (plgpu.kernel: the body sees whole arrays in GPU memory, each
    program moves its row through registers). GPUs only."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows = q.reshape(num_programs, -1)

    def body(in_ref, out_ref):
        program = jax.lax.axis_index("program")
        out_ref[program] = in_ref[program]

    out = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(rows.shape, rows.dtype), grid=(num_programs,),
                       grid_names=("program",))(rows)
    return out.reshape(q.shape)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=384, help="filled cache slots (prompt + tokens so far)")
    parser.add_argument("--cache", type=int, default=512)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--only", default="", help="run only the variants whose names match this regex")
    parser.add_argument("--name", default="kernel_chain_latency")
    parser.add_argument("--out-dir", default="benchmarks/results/probes")
    args = parser.parse_args()
    config = SHAPES[args.shape][0]  # the target
    interpret = jax.default_backend() != "gpu"
    B, H, K, E, D = args.batch, config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, 1, H, E), dtype)
    hidden = jax.random.normal(keys[1], (B, 1, D), dtype)
    scale = jnp.ones((D,), dtype)
    k_new = jax.random.normal(keys[2], (B, 1, K, E), dtype)
    caches = [jax.random.normal(keys[3], (B, args.cache, K, E), dtype) for _ in range(2 * LINKS)]
    slots = jnp.full((B, 1), args.context - 1, jnp.int32)

    def attention(num_splits=None):
        def link(x, i, *caches):
            out, k, v = attention_kernel.decode_attention(
                x, k_new, k_new, caches[2 * i], caches[2 * i + 1], slots, num_splits=num_splits, interpret=interpret)
            return (out, *caches[:2 * i], k, v, *caches[2 * i + 2:])
        return link

    variants = {
        "barrier": (lambda x, i: (x,), q),
        "xla_scale": (lambda x, i: ((x * 1.001).astype(x.dtype),), q),
        "xla_rms_norm": (lambda x, i: (normalize(x, scale, None, config),), hidden),
        "pallas_copy": (lambda x, i: (pallas_copy(x, B * K * 8, interpret),), q),
        "pallas_copy_one_program": (lambda x, i: (pallas_copy(x, 1, interpret),), q),
        **({} if interpret else {  # Mosaic GPU has no interpret mode here
            "mosaic_copy": (lambda x, i: (mosaic_copy(x, 8),), q),
            "mosaic_copy_one_program": (lambda x, i: (mosaic_copy(x, 1),), q)}),
        "attention": (attention(), q, *caches),
        **{f"attention_splits_{n}": (attention(n), q, *caches) for n in (1, 2, 4, 8)},
    }
    rows = []
    for name, (link, *inputs) in variants.items():
        if not re.search(args.only, name):
            continue
        timing = benchmarking.time_in_loop(chain(link), *inputs, carry=True, iterations=args.iterations)
        rows.append({"variant": name, "us_per_link": timing["median_s"] / LINKS * 1e6,
                     "min_us": timing["min_s"] / LINKS * 1e6, "max_us": timing["max_s"] / LINKS * 1e6})
        print(rows[-1], flush=True)
    meta = {**benchmarking.environment(), "shape": args.shape, "batch": B, "context": args.context,
            "cache": args.cache, "links": LINKS, "dtype": "bfloat16"}
    columns = [("variant", "variant"), ("us_per_link", "µs a link (median)"), ("min_us", "fastest"),
               ("max_us", "slowest")]
    print("wrote", *benchmarking.write_results(args.name, rows, columns, meta, args.out_dir,
                                               notes="Written by benchmarks/probes/kernel_chain_latency.py; see its "
                                                     "docstring for the method."))


if __name__ == "__main__":
    main()

"""The decode step's weight products: XLA's against a Pallas GEMV (defined here) and its tilings.

    python -m benchmarks.probes.bench_gemv [--rows 1] [--shapes qkv,o,gate_up,down,lm_head] [--name bench_gemv]

For each weight shape of the 8B-shaped layer in the decoding layout ([in, out], q/k/v and gate/up
fused), M rows times the weight, chained through `copies` distinct weights (a residual add between
them, as in a layer) so that no weight is read from the L2 cache (over 1 GB a chain, against 50 MB of
L2): XLA's dot, then the Pallas GEMV under each tiling of a grid (block_n x block_k x contraction
splits for a target number of programs, x tensor-core or vector-unit products for one row). Times
are medians inside a jitted loop (benchmarking.time_in_loop), reported as read bandwidth against the
copy bandwidth measured in the same run, and the best tiling per shape against XLA. Then the layer's
four products and the LM head as a 32-layer chain (matmuls only), with XLA's products and with each
shape's best tiling: what the kernel would save a decode step. Each tiling's product is first
checked against XLA's on the same inputs (a tiling that computes something else is reported, not timed).

The kernel: grid (column block n, contraction split s); a program reads a [K / S, BN] slab of w in
BK-row steps and accumulates its rows' products in float32; XLA adds the S partial sums after the
call. Rows go to the tensor cores padded to 16 (`dot`), or one row is multiplied and summed on the
vector units (`fma`). Results: benchmarks/results/probes/bench_gemv_m*.md; what they concluded:
docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from specjax import benchmarking
from specjax.benchmarking import SHAPES

MIN_ROWS = 16  # rows of a tensor-core product


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """block_n: columns a program owns; block_k: contraction rows a step of its loop reads;
    splits: programs sharing one column block's contraction; fma: one row on the vector units."""

    block_n: int = 64
    block_k: int = 256
    splits: int = 4
    fma: bool = False
    num_warps: int = 4
    num_stages: int = 3


def _kernel(x_ref, w_ref, out_ref, *, block_k: int, steps: int, fma: bool):
    def step(i, acc):
        k = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        w = w_ref[k, :]  # [BK, BN]
        if fma:  # x_ref is [K / S, 1]
            return acc + jnp.sum(x_ref[k, :].astype(jnp.float32) * w.astype(jnp.float32), axis=0, keepdims=True)
        return acc + jax.lax.dot_general(x_ref[:, k], w, (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    out_ref[...] = jax.lax.fori_loop(0, steps, step, jnp.zeros(out_ref.shape, jnp.float32))


def gemv(x: Float[Array, "M K"], w: Float[Array, "K N"], config: GemvConfig = GemvConfig(), *,
         interpret: bool | None = None) -> Float[Array, "M N"]:
    """x @ w accumulated in float32, returned in x's dtype: the candidate kernel (Pallas, Triton on GPUs)."""
    rows, size_k = x.shape
    size_n = w.shape[1]
    c = config
    if w.shape[0] != size_k:
        raise ValueError(f"gemv: x is [M, {size_k}] but w is {list(w.shape)}: w must be [{size_k}, N]")
    if c.fma and rows != 1:
        raise ValueError(f"gemv: config.fma takes one row, got M = {rows}")
    for name, size, block in (("block_n", size_n, c.block_n), ("block_k", size_k // c.splits, c.block_k)):
        if size % block or block & (block - 1):
            raise ValueError(f"gemv: config.{name} = {block} must be a power of two dividing {size} "
                             f"(w is {list(w.shape)}, splits = {c.splits})")
    if size_k % c.splits:
        raise ValueError(f"gemv: config.splits = {c.splits} must divide the contraction size {size_k}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    split_k = size_k // c.splits
    padded = 1 if c.fma else max(MIN_ROWS, pl.next_power_of_2(rows))
    if c.fma:
        x_in, x_block = x.reshape(size_k, 1), pl.BlockSpec((split_k, 1), lambda n, s: (s, 0))
    else:
        x_in = jnp.pad(x, ((0, padded - rows), (0, 0)))
        x_block = pl.BlockSpec((padded, split_k), lambda n, s: (0, s))
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        compiler_params = pltriton.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages)
    partial = pl.pallas_call(
        functools.partial(_kernel, block_k=c.block_k, steps=split_k // c.block_k, fma=c.fma),
        grid=(size_n // c.block_n, c.splits),
        in_specs=[x_block, pl.BlockSpec((split_k, c.block_n), lambda n, s: (s, n))],
        out_specs=pl.BlockSpec((None, padded, c.block_n), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((c.splits, padded, size_n), jnp.float32),
        interpret=interpret,
        compiler_params=compiler_params,
        name="gemv",
    )(x_in, w)
    return partial.sum(axis=0)[:rows].astype(x.dtype)


def tilings(size_k: int, size_n: int, rows: int):
    """The grid of GemvConfigs tried for one weight shape (each once)."""
    seen = set()
    for block_n, block_k, programs, fma in itertools.product((64, 128), (128, 256), (264, 528, 1056),
                                                             (False, True) if rows == 1 else (False,)):
        if size_n % block_n or size_k % block_k:
            continue
        divisors = [s for s in range(1, size_k // block_k + 1) if (size_k // block_k) % s == 0]
        splits = min(divisors, key=lambda s: abs(s * size_n // block_n - programs))
        if (block_n, block_k, splits, fma) in seen:
            continue
        seen.add((block_n, block_k, splits, fma))
        yield GemvConfig(block_n=block_n, block_k=block_k, splits=splits, fma=fma)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    parser.add_argument("--chain-bytes", type=float, default=1.5e9, help="weight bytes a chain reads")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out-dir", default="benchmarks/results/probes")
    args = parser.parse_args()
    config, _ = SHAPES[args.shape]
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    Q, KV = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"qkv": (D, Q + 2 * KV), "o": (Q, D), "gate_up": (D, 2 * F), "down": (F, D), "lm_head": (D, V)}
    dtype, M = jnp.bfloat16, args.rows
    bandwidth = benchmarking.copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s, rows {M}", flush=True)

    def chain(product, size_k):
        def run(weights, x):
            for w in weights:
                y = product(x, w)
                x = x + (y[:, :size_k] if y.shape[1] >= size_k else jnp.pad(y, ((0, 0), (0, size_k - y.shape[1]))))
            return x
        return run

    def bandwidth_of(product, weights, x):
        seconds = benchmarking.time_in_loop(chain(product, x.shape[1]), weights, x, invariant=1)["median_s"]
        return sum(w.size * w.dtype.itemsize for w in weights) / seconds, seconds

    rows, best = [], {}
    key = jax.random.key(0)
    for name in args.shapes.split(","):
        size_k, size_n = shapes[name]
        copies = max(2, round(args.chain_bytes / (size_k * size_n * 2)))
        weights = [jax.random.normal(jax.random.fold_in(key, i), (size_k, size_n), dtype) * 0.01 for i in range(copies)]
        x = jax.random.normal(key, (M, size_k), dtype)
        xla_bw, xla_s = bandwidth_of(lambda x, w: x @ w, weights, x)
        rows.append({"shape": name, "K": size_k, "N": size_n, "M": M, "impl": "xla", "TBps": xla_bw / 1e12,
                     "of_copy": xla_bw / bandwidth, "vs_xla": 1.0, "us_each": xla_s / copies * 1e6})
        print(rows[-1], flush=True)
        best[name] = (xla_bw, None)
        expected = np.asarray(x @ weights[0], np.float32)
        for tiling in tilings(size_k, size_n, M):
            try:
                got = np.asarray(gemv(x, weights[0], tiling), np.float32)
                if not np.allclose(got, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max()):
                    raise ValueError(f"differs from XLA's product by up to {np.abs(got - expected).max():.3g}")
                bw, seconds = bandwidth_of(lambda x, w, t=tiling: gemv(x, w, t), weights, x)
            except (ValueError, jax.errors.JaxRuntimeError) as error:  # reported, not timed
                print(f"{name} {tiling}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            rows.append({"shape": name, "K": size_k, "N": size_n, "M": M, "impl": "pallas", "block_n": tiling.block_n,
                         "block_k": tiling.block_k, "splits": tiling.splits, "fma": tiling.fma,
                         "programs": tiling.splits * size_n // tiling.block_n, "TBps": bw / 1e12,
                         "of_copy": bw / bandwidth, "vs_xla": bw / xla_bw, "us_each": seconds / copies * 1e6})
            print(rows[-1], flush=True)
            if bw > best[name][0]:
                best[name] = (bw, tiling)
        del weights

    # The layer's products as a decode step chains them, 32 layers and the LM head.
    if set(shapes) <= set(best):
        layer_weights = [{n: jax.random.normal(jax.random.fold_in(key, 1000 + 10 * i + j), shapes[n], dtype) * 0.01
                          for j, n in enumerate(("qkv", "o", "gate_up", "down"))} for i in range(config.num_layers)]
        head = jax.random.normal(key, shapes["lm_head"], dtype) * 0.01
        total = sum(w.size * 2 for layer in layer_weights for w in layer.values()) + head.size * 2

        def step(product):
            def run(layer_weights, head, x):
                for w in layer_weights:
                    qkv = product("qkv", x, w["qkv"])
                    x = x + product("o", qkv[:, :Q], w["o"])
                    gate, up = jnp.split(product("gate_up", x, w["gate_up"]), 2, axis=-1)
                    x = x + product("down", jax.nn.silu(gate) * up, w["down"])
                return product("lm_head", x, head)
            return run

        def xla(name, x, w):
            return x @ w

        def tuned(name, x, w):
            tiling = best[name][1]
            return x @ w if tiling is None else gemv(x, w, tiling)

        x = jax.random.normal(key, (M, D), dtype)
        for label, product in (("xla", xla), ("pallas_best", tuned)):
            seconds = benchmarking.time_in_loop(step(product), layer_weights, head, x, invariant=2)["median_s"]
            rows.append({"shape": "layers_32_and_lm_head", "M": M, "impl": label, "TBps": total / seconds / 1e12,
                         "of_copy": total / seconds / bandwidth, "us_each": seconds * 1e6})
            print(rows[-1], flush=True)
        rows[-1]["vs_xla"] = rows[-2]["us_each"] / rows[-1]["us_each"]
    meta = {**benchmarking.environment(), "rows": M, "dtype": "bfloat16", "copy_bandwidth_TBps": bandwidth / 1e12,
            "best": {n: (None if t is None else vars(t)) for n, (_, t) in best.items()}}
    columns = [("shape", "shape"), ("K", "K"), ("N", "N"), ("impl", "impl"), ("block_n", "BN"), ("block_k", "BK"),
               ("splits", "splits"), ("fma", "fma"), ("programs", "programs"), ("us_each", "µs"),
               ("TBps", "TB/s"), ("of_copy", "of copy"), ("vs_xla", "vs XLA")]
    benchmarking.write_results(args.name or f"bench_gemv_m{M}", rows, columns, meta, args.out_dir)


if __name__ == "__main__":
    main()

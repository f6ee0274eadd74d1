"""Does a verification block's last token get the attention output that a decode step at its slot gets?

    python -m benchmarks.probes.decode_attention_rounding [--name decode_attention_rounding_gpu]

pallas_kernels.decode_attention on the GPU (compiled) or the CPU (interpret mode): K + 1 = 6 new tokens
attend as one block, then the last of them again alone (T = 1) with the other five already written to
the cache by the block. Same splits, same blocks, same order of sums; what differs is the row block's
shape (32 rows against 16 at G = 4), so its products and the combine are compiled for other shapes and
may round differently. Per dtype and (batch, fill level) it reports whether the two outputs are bit
for bit equal, the share of equal elements, the largest difference, and whether both calls left the
same caches (they must: the cache write is exact). Greedy speculative decoding equals greedy
autoregressive decoding exactly only where these agree; the tests check that the outputs agree to
rounding (tests/test_decode_attention.py).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from specjax import benchmarking
from specjax.pallas_kernels.decode_attention import decode_attention

NUM_DRAFT, HEADS, KV_HEADS, HEAD_DIM, SLOTS = 5, 32, 8, 128, 512  # Llama-3.1-8B's attention, K = 5


def compare(dtype, batch: int, fill: int) -> dict:
    rng = np.random.default_rng(fill)
    new = NUM_DRAFT + 1

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    q, k_new, v_new = normal(batch, new, HEADS, HEAD_DIM), normal(batch, new, KV_HEADS, HEAD_DIM), \
        normal(batch, new, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = normal(batch, SLOTS, KV_HEADS, HEAD_DIM), normal(batch, SLOTS, KV_HEADS, HEAD_DIM)
    slots = jnp.asarray(np.tile(fill + np.arange(new), (batch, 1)), jnp.int32)
    attend = jax.jit(decode_attention)
    block, k_block, v_block = attend(q, k_new, v_new, k_cache, v_cache, slots)
    last = slice(NUM_DRAFT, new)
    step, k_step, v_step = attend(q[:, last], k_new[:, last], v_new[:, last], k_block, v_block, slots[:, last])
    a, b = (np.asarray(x.astype(jnp.float32)) for x in (block[:, NUM_DRAFT], step[:, 0]))
    same_caches = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in ((k_block, k_step), (v_block, v_step)))
    return {"dtype": jnp.dtype(dtype).name, "B": batch, "fill": fill, "bit_identical": bool(np.array_equal(a, b)),
            "share_equal": float((a == b).mean()), "max_abs_diff": float(np.abs(a - b).max()),
            "same_caches": same_caches}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default=None, help="default: decode_attention_rounding_<platform>")
    parser.add_argument("--out-dir", default="benchmarks/results/probes")
    args = parser.parse_args()
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for batch, fill in ((1, 127), (1, 300), (4, 200), (16, 250)):
            rows.append(compare(dtype, batch, fill))
            print(rows[-1], flush=True)
    meta = {**benchmarking.environment(), "num_draft": NUM_DRAFT, "heads": HEADS, "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "slots": SLOTS, "compiled": jax.default_backend() == "gpu"}
    columns = [("dtype", "dtype"), ("B", "B"), ("fill", "fill"), ("bit_identical", "bit identical"),
               ("share_equal", "share of equal elements"), ("max_abs_diff", "largest difference"),
               ("same_caches", "same caches")]
    name = args.name or f"decode_attention_rounding_{jax.default_backend()}"
    print("wrote", *benchmarking.write_results(name, rows, columns, meta, args.out_dir,
                                               notes="Written by benchmarks/probes/decode_attention_rounding.py."))


if __name__ == "__main__":
    main()

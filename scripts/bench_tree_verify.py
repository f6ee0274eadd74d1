"""The tree verifiers' cost on the device: recursive rejection sampling, traversal verification and greedy,
one call inside a jitted loop (benchmarking.time_in_loop), at a Llama-3 vocabulary.

    PYTHONPATH=. python scripts/bench_tree_verify.py [--batches 1,4,16] [--nodes 16,32,60] [--vocab 128256]
        [--name bench_tree_verify]

Random inputs (specjax.verify.testing.random_verify_inputs, float32) on a random tree whose parents come
before their children; drafts one-hot (top-k trees, EAGLE-2's) or sampled (draft_probs given). The floor is
reading the target's probabilities once, [B, N + 1, V] float32 (and the draft's, when sampled), at the
copy bandwidth measured in the same run. Writes benchmarks/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import benchmarking
from specjax.verify import tree
from specjax.verify.testing import random_verify_inputs

VERIFIERS = {"recursive rejection sampling": tree.verify_tree, "traversal": tree.verify_tree_traversal}


def random_parents(batch: int, num_nodes: int, seed: int) -> jax.Array:
    """Each node's parent drawn among the root and the nodes before it, favouring recent ones (deep trees)."""
    rng = np.random.default_rng(seed)
    parents = [[-1] + [int(rng.integers(max(-1, i - 4), i)) for i in range(1, num_nodes)] for _ in range(batch)]
    return jnp.asarray(parents, jnp.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--nodes", default="16,32,60")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default="bench_tree_verify")
    args = parser.parse_args()

    bandwidth = benchmarking.copy_bandwidth()
    rows = []
    for batch, num_nodes in itertools.product(map(int, args.batches.split(",")), map(int, args.nodes.split(","))):
        target, tokens, draft, _ = random_verify_inputs(batch, num_nodes, args.vocab, seed=batch + num_nodes)
        parents = random_parents(batch, num_nodes, seed=num_nodes)
        keys = jax.random.split(jax.random.key(0), batch)
        for drafting, draft_probs in (("top-k (one-hot)", None), ("sampled", draft)):
            floor_bytes = 4 * target.size + (0 if draft_probs is None else 4 * draft_probs.size)
            row = {"B": batch, "nodes": num_nodes, "drafting": drafting, "floor_ms": floor_bytes / bandwidth * 1e3}
            for name, verify in VERIFIERS.items():
                if draft_probs is None:
                    fn = lambda t, x, p, k, verify=verify: verify(t, x, p, None, k)
                    timing = benchmarking.time_in_loop(fn, target, tokens, parents, keys)
                else:
                    timing = benchmarking.time_in_loop(verify, target, tokens, parents, draft_probs, keys)
                row[name] = timing["median_s"] * 1e3
                _, length, _ = jax.jit(verify)(target, tokens, parents, draft_probs, keys)
                row[f"{name} length"] = float(jnp.mean(length))
            row["greedy"] = benchmarking.time_in_loop(
                lambda t, x, p: tree.verify_tree_greedy(jnp.argmax(t, -1), x, p), target, tokens, parents)["median_s"] * 1e3
            rows.append(row)
            print(row, flush=True)
    meta = {**benchmarking.environment(), "vocab": args.vocab, "dtype": "float32",
            "copy_bandwidth_GBps": bandwidth / 1e9}
    columns = [("B", "B"), ("nodes", "nodes"), ("drafting", "drafts"), ("floor_ms", "floor ms (read p, q once)"),
               *((name, f"{name} ms") for name in VERIFIERS), ("greedy", "greedy ms (argmax included)")]
    paths = benchmarking.write_results(args.name, rows, columns, meta, args.out_dir)
    print("wrote", *paths)


if __name__ == "__main__":
    main()

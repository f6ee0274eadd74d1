"""Is top-p speculative sampling still lossless at large batches on this backend, with and without the
optimization barrier in `processed_logits`?

    PYTHONPATH=. python scripts/top_p_fusion_check.py [--rows 4096,16384,21845,32768,131072]
    PYTHONPATH=. python scripts/top_p_fusion_check.py --cost [--cost-shapes 1x6,16x6,64x6]

On the H200 with jax 0.11.2, XLA fused the sorted probabilities of top-p into kernels that computed
wrong kept sets inside the speculative loop once the batch passed about 20k rows (block verification,
greedy drafts, top-p 0.8: whole rows of NaN target probabilities, acceptance 0, chi-square p = 0).
The same code jitted alone was right, so no small reproducer exists; this script re-runs the measurement
of tests/test_speculative.py::test_speculative_sampling_is_lossless (same tiny pair, same exact joint
distribution of the first three tokens) at several batch sizes. Run it after a JAX upgrade to see
whether the barrier is still needed.

--cost times what the barrier costs instead: sampling.processed_probs with top-p over a Llama-3
vocabulary (128256) for B x (K + 1) rows of target logits, with and without the barrier, inside a jitted
loop (benchmarking.time_in_loop). The barrier makes XLA write the probabilities out once more.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

from specjax import benchmarking
from specjax.config import SamplingConfig, SpecConfig
from specjax.verify.sampling import processed_probs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # the test's exact oracle
import test_speculative as oracle  # noqa: E402
from conftest import chi_square_pvalue  # noqa: E402

SAMPLING = SamplingConfig(temperature=1.0, top_p=0.8)


@contextlib.contextmanager
def barrier(kept: bool):
    """Without it, optimization_barrier called from specjax.verify.sampling is the identity (others,
    such as benchmarking.time_in_loop's, stay); nothing compiled earlier is reused."""
    original = jax.lax.optimization_barrier

    def barrier_outside_sampling(operand):
        called_from = sys._getframe(1).f_globals.get("__name__")
        return operand if called_from == "specjax.verify.sampling" else original(operand)

    if not kept:
        jax.lax.optimization_barrier = barrier_outside_sampling
    jax.clear_caches()
    try:
        yield
    finally:
        jax.lax.optimization_barrier = original
        jax.clear_caches()


def measure(rows: int, method: str, exact) -> dict:
    oracle.NUM_ROWS = rows
    spec = SpecConfig(num_speculative_tokens=2, rejection_sample_method=method, draft_sample_method="greedy")
    start = time.perf_counter()
    counts, metrics = oracle.speculative_joint_counts(spec, SAMPLING)
    return {"rows": rows, "method": method, "acceptance_rate": metrics.summary()["acceptance_rate"],
            "chi_square_p": chi_square_pvalue(counts, exact), "seconds": time.perf_counter() - start}


def barrier_cost(shapes: list[tuple[int, int]], vocab: int = 128256) -> list[dict]:
    """Median time of processed_probs(top-p) over [B, T, vocab] float32 logits, with and without the barrier."""
    results = []
    for batch, num_new in shapes:
        logits = 4.0 * jax.random.normal(jax.random.key(0), (batch, num_new, vocab), jnp.float32)
        row = {"batch": batch, "positions": num_new, "vocab": vocab}
        for kept in (True, False):
            with barrier(kept):
                timing = benchmarking.time_in_loop(lambda x: processed_probs(x, SAMPLING), logits, iterations=20)
            row["with_ms" if kept else "without_ms"] = timing["median_s"] * 1e3
        row["ratio"] = row["with_ms"] / row["without_ms"]
        results.append(row)
        print(row, flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="4096,16384,21845,32768,131072", help="batch sizes, comma-separated")
    parser.add_argument("--methods", default="block,standard")
    parser.add_argument("--name", default=None, help="default: top_p_fusion_check_<platform>, or "
                                                      "top_p_barrier_cost_<platform> with --cost")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--cost", action="store_true", help="time the barrier instead of checking the distribution")
    parser.add_argument("--cost-shapes", default="1x6,16x6,64x6", help="B x (K + 1) shapes of target logits")
    args = parser.parse_args()
    if args.cost:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.cost_shapes.split(",")]
        results = barrier_cost(shapes)
        columns = [("batch", "B"), ("positions", "K + 1"), ("vocab", "V"), ("with_ms", "with barrier ms"),
                   ("without_ms", "without ms"), ("ratio", "with / without")]
        meta = {**benchmarking.environment(), "sampling": str(SAMPLING), "dtype": "float32"}
        name = args.name or f"top_p_barrier_cost_{jax.default_backend()}"
        print("wrote", *benchmarking.write_results(name, results, columns, meta, args.out_dir,
                                                   notes="Written by scripts/top_p_fusion_check.py --cost."))
        return
    exact = oracle.exact_joint(oracle.tiny_pair()[0], SAMPLING)
    results = []
    for kept in (True, False):
        with barrier(kept):
            for rows in (int(r) for r in args.rows.split(",")):
                for method in args.methods.split(","):
                    results.append({"barrier": kept, **measure(rows, method, exact)})
                    print(results[-1], flush=True)
    meta = {**benchmarking.environment(), "sampling": str(SAMPLING), "num_speculative_tokens": 2,
            "draft_sample_method": "greedy", "tokens_per_row": oracle.NUM_TOKENS}
    columns = [("barrier", "barrier"), ("rows", "rows"), ("method", "verifier"),
               ("acceptance_rate", "acceptance rate"), ("chi_square_p", "chi-square p"), ("seconds", "s")]
    name = args.name or f"top_p_fusion_check_{jax.default_backend()}"
    print("wrote", *benchmarking.write_results(name, results, columns, meta, args.out_dir,
                                               notes="Written by scripts/top_p_fusion_check.py. Lossless "
                                                     "means chi-square p well above 1e-3 (the test's bar)."))


if __name__ == "__main__":
    main()

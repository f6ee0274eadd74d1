"""`total_tokens: auto` at the 8B shape: the tree size it picks at each batch size, against every candidate
size measured in the same run.

    PYTHONPATH=. python scripts/bench_tree_size.py [--batches 1,4,16] [--shape 8b|tiny] [--depth 6]
        [--top-k 8] [--acceptance-length 6.0] [--draft-logit-scale 10] [--name bench_tree_size]

Random bfloat16 weights: the 8B-shaped target and the EAGLE-3 head of scripts/bench_decode.py (its LM head
scaled by --draft-logit-scale for confident, deep trees), prompts of 128 tokens, 256 new tokens, greedy.
The verifier is synthetic (the first-ranked path accepted to --acceptance-length tokens), so acceptance
barely depends on the size here: what the table checks is the cost side of the choice, the predicted
step time T_verify(n + 1) + T_rest against the measured one, and the tokens/s of every size; the
acceptance side (the drafter's confidences) is what real heads supply (`specjax sweep
configs/sweeps/eagle_tree_auto.yaml` on the default models). Writes benchmarks/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax

from specjax import benchmarking
from specjax.decoding import run_speculative
from specjax.trees.sizing import choose_tree_size
from specjax.metrics import AcceptanceMetrics
from specjax.speed import (build_drafter, build_target, cache_size_for, generation_args, speculative_run, synthetic_spec,
                           tokens_per_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(benchmarking.SHAPES), default="8b")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--acceptance-length", type=float, default=6.0)
    parser.add_argument("--draft-logit-scale", type=float, default=10.0)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default="bench_tree_size")
    args = parser.parse_args()

    target_config, draft_config = benchmarking.SHAPES[args.shape]
    target = build_target(target_config)
    head = build_drafter("eagle3", target_config, draft_config)
    head.lm_head.set_value(head.lm_head[...] * args.draft_logit_scale)
    auto = synthetic_spec("eagle3", args.acceptance_length, args.depth, total_tokens="auto", tree_top_k=args.top_k)
    sizes = auto.auto_tree_sizes
    rows = []
    for batch in map(int, args.batches.split(",")):
        cache_size = cache_size_for(args.prompt_len, args.new_tokens, sizes[-1])
        run_args = generation_args(target, batch, args.prompt_len, args.new_tokens, sizes[-1] + 1, cache_size)
        one_args = generation_args(target, batch, args.prompt_len, 1, sizes[-1] + 1, cache_size)
        run = functools.partial(run_speculative, target, head, run_args, cache_size=cache_size)
        choice = choose_tree_size(run, target, auto, batch)
        print(choice.table())
        for size, tau_estimate, verify_s, rest_s, predicted in zip(sizes, choice.acceptance, choice.verify_s,
                                                                   choice.rest_s, choice.predicted_tok_s):
            spec = dataclasses.replace(auto, total_tokens=size)
            tok_s, _ = tokens_per_s(speculative_run(target, head, spec, cache_size), run_args, one_args)
            final = speculative_run(target, head, spec, cache_size, final_state=True)(run_args)
            measured_tau = AcceptanceMetrics.from_counters(final.counters, batch).summary()["mean_acceptance_length"]
            rows.append({"B": batch, "nodes": size, "auto": size == choice.total_tokens,
                         "estimated_tau": tau_estimate, "measured_tau": measured_tau,
                         "t_verify_ms": verify_s * 1e3, "rest_ms": rest_s * 1e3,
                         "predicted_step_ms": (verify_s + rest_s) * 1e3,
                         "measured_step_ms": batch * measured_tau / tok_s * 1e3,
                         "predicted_tok_s": predicted, "tok_s": tok_s})
            print(rows[-1])
        meta = {**benchmarking.environment(), "shape": args.shape, "weights": "random bfloat16",
                "drafter": "eagle3 (32000-id draft vocabulary)", "depth": args.depth, "top_k": args.top_k,
                "acceptance": f"synthetic, first-ranked path to {args.acceptance_length:g}",
                "draft_logit_scale": args.draft_logit_scale, "prompt": args.prompt_len, "new_tokens": args.new_tokens}
        columns = [("B", "B"), ("nodes", "nodes"), ("auto", "auto's pick"), ("estimated_tau", "estimated τ"),
                   ("measured_tau", "measured τ"), ("t_verify_ms", "T_verify(n+1) ms"), ("rest_ms", "T_rest ms"),
                   ("predicted_step_ms", "predicted step ms"), ("measured_step_ms", "measured step ms"),
                   ("predicted_tok_s", "predicted tok/s"), ("tok_s", "measured tok/s")]
        paths = benchmarking.write_results(args.name, rows, columns, meta, args.out_dir)
    print("wrote", *paths)
    jax.clear_caches()


if __name__ == "__main__":
    main()

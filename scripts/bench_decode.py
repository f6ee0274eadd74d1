"""Decoding speed against the memory floor: autoregressive and speculative, Llama-3.1-8B-shaped target.

    PYTHONPATH=. python scripts/bench_decode.py [--batches 1,4,16,64] [--prompt-lens 128,1024]
        [--new-tokens 256] [--acceptance-lengths 4.0] [--num-speculative-tokens 5]
        [--methods eagle,eagle_fr,eagle3,draft_model] [--shape 8b|tiny] [--dtype bfloat16|float32] [--model-parallel N]
        [--tree-nodes 60 --tree-top-k 8 --draft-logit-scale 10] [--acceptance-rates 0.8,0.6,...] [--adaptive] [--fixed-k 1,2,4,8]
    PYTHONPATH=. python scripts/bench_decode.py --plot benchmarks/results/bench_decode.json [more.json ...]

Random bfloat16 weights (speed does not depend on their values): a Llama-3.1-8B-shaped target and the
drafters in --methods: an EAGLE-1 head for the 8B shape (eagle), the same head drafting over a
32000-token draft vocabulary (eagle_fr, FR-Spec: a draft step reads those 32000 rows of the target's LM
head, gathered once per generation; method eagle), an EAGLE-3 head with its own LM head over a
32000-token draft vocabulary, as released for Llama-3.1-8B (eagle3; a draft step then reads a quarter of
the LM-head bytes), a Llama-3.2-1B-shaped draft LM (draft_model), a DFlash drafter of z-lab's 8B shape
(dflash: 5 layers, block 16; one forward drafts all K), the same drafter over a 32000-token draft
vocabulary (dflash_fr, FR-Spec: its logits read those rows of the target's LM head), one MTP module in
MiMo's layout applied K times (mtp; with --shape mimo7b the target is MiMo-7B's Qwen2 shape, its first MTP
module as released; T_draft of its bound is one call over its window of K + 1 entries, which drafts the
first token, plus K - 1 single steps: specjax.proposers.mtp). For each batch
size and prompt length it reports:
- autoregressive step time and tokens/s (whole-generation time minus a one-token run, over the
  remaining steps), and its fraction of the HBM floor: the bytes a step must read (every weight but
  the untied embedding table, of which only B rows are read, plus each row's valid KV entries at the
  mean context length) over the copy bandwidth measured in the same run: the highest of its
  measurements before the first case and after each (they differ by up to a few percent within a
  run, and by up to 8% between processes on the same GPU; the highest gives the lowest floor);
- speculative tokens/s with synthetic acceptance at set mean lengths tau (K drafts), beside the
  analytic bound tau * T_AR / (T_verify(K + 1) + K * T_draft) from component times measured in the
  same run (T_verify: one target forward over K + 1 positions; T_draft: one drafter step; DFlash's
  one step drafts all K, so its bound has T_draft once), and the
  speedup over autoregressive.
With --tree-nodes N the EAGLE drafters draft dynamic trees (EAGLE-2: depth K, top-k --tree-top-k, N nodes)
and the synthetic verifier accepts tau along each tree's first-ranked path; T_verify is then the forward
over N + 1 positions under a tree mask and T_draft one head step over top-k rows under one, and the
table gives the mean acceptance length the runs measured (a tree whose first-ranked path is shorter
than tau accepts less). A random head's drafts are far less confident than a trained one's, so a tree
of the highest path probabilities would be wide and shallow: --draft-logit-scale multiplies the EAGLE-3
head's LM head (confident, peaked drafts, and trees as deep as EAGLE-2's).
With --model-parallel N the models are split over N GPUs and greedy tokens are compared with one
GPU's; at a first difference the gap between the two tokens' logits (one GPU, full forward) says
whether it is a near-tie decided by summation order (bfloat16 random weights leave many; --dtype
float32 for an identity check). Writes benchmarks/results/bench_decode.{json,md}, after every case;
--plot draws tokens/s against batch size from results files (bench_decode_batch_scaling.png) and, for
--adaptive results, the mean chosen width beside the best fixed K (bench_decode_adaptive_widths.png).
--acceptance-rates r1,r2,... replaces --acceptance-lengths by a per-position profile (position i accepted with
the unconditional rate r_i; the first K of them; its tau is 1 + their sum). --adaptive also runs each case with
adaptive verification (specjax.adaptive: the widths 0, powers of two and K, the cost curve profiled on the
device once per shape, batch and cache and kept on disk), its tokens/s and mean verified width beside fixed K's;
--with-widest-runs also runs it with steps held at K in a loop of their own (speculative_loop's widest_runs).
--fixed-k k1,k2,... also times each drafter at those fixed K (with --acceptance-rates each K's tau is 1 + the sum
of the profile's first K rates): the envelope adaptive verification is compared with, best K named per row; with
each K its loop's steps (its slowest row's: the loop runs until every row is done) and a step's time, to set
against adaptive's at the same width.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import adaptive, benchmarking, sharding
from specjax.trees import masks, structure
from specjax.config import SamplingConfig, SpecConfig
from specjax.decoding import decode_loop, speculative_loop, step_timing
from specjax.metrics import AcceptanceMetrics
from specjax.models.transformer import Hidden
from specjax.proposers.base import build_proposer
from specjax.speed import (DRAFTERS, GREEDY, autoregressive_run, build_drafter, build_target, cache_size_for,
                           generation_args, spec_method, speculative_run, synthetic_spec, tokens_per_s)


def component_times(target, drafters: dict, batch: int, context: int, num_draft: int, cache_size: int,
                    tree_nodes: int = 0, top_k: int = 1) -> dict:
    """Median device times (in a jitted loop) of one target forward over 1 and K + 1 positions (N + 1
    under a tree mask for trees of N nodes) and of one step of each drafter (over top_k rows under a tree
    mask for trees), at `context` committed tokens per row. Weights are loop-invariant (as in
    the decode loops); caches are carried from one iteration to the next with their lengths reset, so
    their writes are in place as in the decode loops (benchmarking.time_in_loop)."""
    cfg = target.config
    measure = lambda fn, *args: benchmarking.time_in_loop(fn, *args, invariant=1, carry=True,  # noqa: E731
                                                          iterations=10)["median_s"]
    cache = target.create_cache(batch, cache_size).with_lengths(jnp.full((batch,), context, jnp.int32))

    def forward(model, cache, tokens, mask=None):
        positions = context + jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits, _, written = model(tokens, positions, cache, attention_mask=mask)
        return logits, (written.with_lengths(cache.lengths), tokens, mask)

    def tree_mask(rows: int):  # which parents does not change the cost: the chain's
        return masks.attention_mask(structure.chain_parents(batch, rows - 1), jnp.full((batch,), context),
                                         cache_size)

    block = (tree_nodes or num_draft) + 1
    # The verification forward takes the tree's mask as the loop gives it (the attention kernel's form).
    verify_mask = masks.tree_mask(structure.chain_parents(batch, block - 1)) if tree_nodes else None
    times = {"t_ar_forward_s": measure(forward, target, cache, jnp.zeros((batch, 1), jnp.int32), None),
             "t_verify_s": measure(forward, target, cache, jnp.zeros((batch, block), jnp.int32), verify_mask)}
    for method, drafter in drafters.items():
        draft_cache = drafter.create_cache(batch, cache_size).with_lengths(jnp.full((batch,), context, jnp.int32))
        if method == "draft_model":
            times["t_draft_draft_model_s"] = measure(forward, drafter, draft_cache, jnp.zeros((batch, 1), jnp.int32),
                                                     None)
            continue
        if method.startswith("dflash"):  # the whole block's drafts in one step: the pending features, the block
            times[f"t_draft_{method}_s"] = dflash_step(drafter, target, batch, context, num_draft)(draft_cache)
            continue
        if method == "mtp":  # the module over its window of K + 1 entries, then one step per further draft
            for name, rows in (("t_draft_mtp_window_s", num_draft + 1), ("t_draft_mtp_s", 1)):
                times[name] = mtp_step(drafter, target, batch, context, rows, cache_size)(draft_cache)
            continue
        # One EAGLE draft step as the proposer runs it: the head's layer, then logits through the
        # target's LM head (EAGLE-1), its rows of the draft vocabulary (gathered in bind, outside the
        # timed loop, as once per generation: eagle_fr) or the head's own over its draft vocabulary (EAGLE-3).
        proposer = build_proposer(SpecConfig(method=spec_method(method), num_speculative_tokens=num_draft),
                                  SamplingConfig(), cache_size, drafter)

        def eagle_step(params, cache, tokens, features, mask, proposer=proposer):
            positions = jnp.full(tokens.shape, context, jnp.int32)
            out, written = params.head(tokens, features, positions, cache, params.embed, attention_mask=mask)
            return proposer.logits(params, out), (written.with_lengths(cache.lengths), tokens, features, mask)

        rows = top_k if tree_nodes else 1  # a tree's head step runs its frontier's top_k nodes together
        times[f"t_draft_{method}_s"] = measure(eagle_step, proposer.bind(drafter, target), draft_cache,
                                               jnp.zeros((batch, rows), jnp.int32),
                                               jnp.zeros((batch, rows, cfg.hidden_size), cfg.jnp_dtype),
                                               tree_mask(rows) if tree_nodes else None)
    return times


def mtp_step(drafter, target, batch: int, context: int, rows: int, cache_size: int):
    """One call of the first MTP module over `rows` entries per row as the proposer runs it (its layer,
    then the logits of the last entry through the target's LM head), as a function of its cache."""
    cfg = target.config
    proposer = build_proposer(SpecConfig(method="mtp", num_speculative_tokens=max(rows - 1, 1)), SamplingConfig(),
                              cache_size, drafter)
    positions = context + jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32), (batch, rows))
    features = jnp.zeros((batch, rows, cfg.hidden_size), cfg.jnp_dtype)

    def step(params, cache):
        out, written = params.modules(0, jnp.zeros((batch, rows), jnp.int32), features, positions, cache, params.embed)
        return proposer.logits(params, out[:, -1]), (written.with_lengths(cache.lengths),)

    return lambda cache: benchmarking.time_in_loop(step, proposer.bind(drafter, target), cache, invariant=1,
                                                   carry=True, iterations=10)["median_s"]


def dflash_step(drafter, target, batch: int, context: int, num_draft: int):
    """One DFlash propose as the proposer runs it, as a function of the drafter's cache: K + 1 pending
    context features written, the block [anchor, K masks] through the layers, logits of the K drafts."""
    cfg = target.config
    hidden = Hidden(final=jnp.zeros((batch, num_draft + 1, cfg.hidden_size), cfg.jnp_dtype),
                    layers=jnp.zeros((len(drafter.config.hidden_layers), batch, num_draft + 1, cfg.hidden_size),
                                     cfg.jnp_dtype))
    positions = context + jnp.broadcast_to(jnp.arange(num_draft + 1, dtype=jnp.int32), (batch, num_draft + 1))
    proposer = build_proposer(SpecConfig(method="dflash", num_speculative_tokens=num_draft), SamplingConfig(),
                              0, drafter)  # for bind and logits only: no cache of its own

    def step(params, cache):
        drafter = params.drafter
        cache = drafter.write_context(drafter.context(hidden), positions, cache).with_lengths(cache.lengths)
        out, written = drafter(jnp.zeros((batch, num_draft + 1), jnp.int32), positions, cache, params.embed)
        # The drafts' logits as the proposer makes them (through a draft vocabulary's rows for dflash_fr).
        return proposer.logits(params, out[:, 1:]), (written.with_lengths(cache.lengths),)

    return lambda cache: benchmarking.time_in_loop(step, proposer.bind(drafter, target), cache, invariant=1,
                                                   carry=True, iterations=10)["median_s"]


def first_difference(model, got: np.ndarray, want: np.ndarray) -> tuple[int, float]:
    """The first position where two greedy runs' tokens differ (over all rows), and the gap between the
    two tokens' logits there under `model` (one forward over the common prefix)."""
    rows, cols = np.nonzero(got != want)
    row, col = rows[np.argmin(cols)], cols.min()
    prefix = jnp.asarray(want[row, :col])[None]
    logits, _, _ = jax.jit(lambda m, t: m(t, jnp.arange(t.shape[1])[None]))(model, prefix)
    last = np.asarray(logits[0, -1], np.float32)
    return int(col), float(abs(last[want[row, col]] - last[got[row, col]]))


def step_collectives(target, drafter, spec: SpecConfig | None, cache_size: int, run_args) -> int:
    """Collectives in one step of the compiled greedy loop (autoregressive when spec is None), the weights
    passed as arguments (closed over, they would be constants of the program)."""
    if spec is None:
        lowered = decode_loop.lower(target, *run_args, sampling=GREEDY, eos_token_ids=(), cache_size=cache_size)
    else:
        proposer = build_proposer(spec, GREEDY, cache_size, drafter)
        lowered = speculative_loop.lower(target, proposer.bind(drafter, target), *run_args, proposer=proposer,
                                         eos_token_ids=())
    return sum(sharding.step_collectives(lowered.compile().as_text()).values())


def run_both(target, drafters, methods, taus, num_draft, cache_size, run_args, tree: dict, rates=None):
    """Final decode states of a greedy autoregressive run and of one synthetic speculative run."""
    states = [autoregressive_run(target, cache_size)(run_args)]
    states += [speculative_run(target, drafters[method], synthetic_spec(method, tau, num_draft, rates=rates, **tree),
                               cache_size)(run_args)
               for method in methods for tau in taus]
    return states


def loop_steps(target, drafter, spec: SpecConfig, cache_size: int, run_args, tok_s: float, verify_costs=None,
               widest_runs: bool = False):
    """(acceptance metrics, the loop's steps, seconds a step) of the run tokens_per_s timed: the same program run
    again for its counters (no compile). The loop steps until its last row is done, so steps are its slowest row's;
    a step's seconds are the run's time (less a one-token run's: tokens_per_s) over them."""
    state = speculative_run(target, drafter, spec, cache_size, final_state=True, verify_costs=verify_costs,
                            widest_runs=widest_runs)(run_args)
    metrics = AcceptanceMetrics.from_counters(state.counters, run_args[0].shape[0])
    steps = int(metrics.steps.max())
    return metrics, steps, (float(np.sum(metrics.emitted)) / tok_s / steps if steps else None)


def adaptive_case(target, drafter, spec: SpecConfig, batch: int, cache_size: int, run_args, one_args, name: str,
                  fixed_tok_s: float, widest_runs: bool = False) -> dict:
    """Tokens/s with adaptive verification (the cost curve profiled once and cached: specjax.adaptive), the mean
    width it verified a step, and its ratio to the same K verified whole; widest_runs as speculative_loop's."""
    proposer = build_proposer(spec, GREEDY, cache_size, drafter)
    timing = step_timing(target, proposer.bind(drafter, target), proposer)
    curve = adaptive.cached_profile(target, batch, spec.verify_widths, cache_size, timing)
    costs = adaptive.verify_costs(spec, curve, batch)
    tok_s, _ = tokens_per_s(speculative_run(target, drafter, spec, cache_size, verify_costs=costs,
                                            widest_runs=widest_runs), run_args, one_args)
    metrics, steps, measured_s = loop_steps(target, drafter, spec, cache_size, run_args, tok_s, verify_costs=costs,
                                            widest_runs=widest_runs)
    # The loop's steps, each at the width its active rows verified (all the same: one width a step), and the step
    # time the curve predicts for them against the one measured.
    widths = metrics.per_step_drafted[:, :steps].max(axis=0)
    predicted_s = float(np.mean(curve.costs(batch, widths))) if steps else None
    return {f"{name}_adaptive_tok_s": tok_s, f"{name}_adaptive_width": metrics.drafted.sum() / metrics.steps.sum(),
            # Steps at width 0: autoregressive steps, which skip drafting where the drafter can (skips_drafting).
            f"{name}_adaptive_width0_share": float(np.mean(widths == 0)) if steps else None,
            f"{name}_adaptive_vs_fixed": tok_s / fixed_tok_s,
            f"{name}_adaptive_step_predicted_ms": None if predicted_s is None else predicted_s * 1e3,
            f"{name}_adaptive_step_measured_ms": None if measured_s is None else measured_s * 1e3,
            f"{name}_adaptive_steps": steps,
            # The widths the loop chose from at this batch: those worth choosing on the curve (adaptive.verify_costs).
            f"{name}_adaptive_widths_kept": [w for w, c in zip(spec.verify_widths, np.asarray(costs))
                                             if c < adaptive.FORCED_OUT],
            f"{name}_adaptive_curve": dict(zip(map(str, curve.widths), curve.seconds[0]))}


def crossover_notes(rows: list[dict], methods: list[str], taus: list[float], prompt_lens: list[int]) -> str:
    """For each drafter, tau and prompt length: the largest batch at which speculation still beats
    autoregressive decoding, and the first at which it does not."""
    lines = []
    for method in methods:
        for tau in taus:
            for prompt_len in prompt_lens:
                speedups = sorted((row["B"], row[f"{method}_tau{tau}_speedup"]) for row in rows
                                  if row["prompt"] == prompt_len)
                pays = [b for b, x in speedups if x > 1.0]
                stops = [b for b, x in speedups if x <= 1.0]
                lines.append(f"- {method}, tau {tau}, prompt {prompt_len}: speculation pays up to batch "
                             f"{max(pays) if pays else 'none'}"
                             + (f"; it stops paying at batch {min(stops)}" if stops else " (every batch measured)"))
    return "\n".join(lines)


def new_plot():
    """A figure and its axes, drawn off screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6.5, 4.5))


def finish_plot(fig, ax, path) -> None:
    import matplotlib.pyplot as plt

    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    benchmarking.save_figure(fig, path)
    plt.close(fig)


def plot_batch_scaling(rows: list[dict], path) -> None:
    """Tokens/s against batch size (log-log): the floor, autoregressive and each speculative decoder,
    a line per prompt length."""
    fig, ax = new_plot()
    speculative = sorted({key[:-len("_tok_s")] for row in rows for key in row
                          if key.endswith("_tok_s") and "_tau" in key and not key.endswith("_bound_tok_s")})
    for prompt_len, style in zip(sorted({row["prompt"] for row in rows}), ("-", "--", ":"), strict=False):
        mine = sorted((row for row in rows if row["prompt"] == prompt_len), key=lambda row: row["B"])
        batches = [row["B"] for row in mine]
        ax.plot(batches, [row["floor_tok_s"] for row in mine], style, color="gray", label=f"AR floor, prompt {prompt_len}")
        ax.plot(batches, [row["ar_tok_s"] for row in mine], style, marker="o", color="C0", label=f"AR, prompt {prompt_len}")
        for i, name in enumerate(speculative):
            ax.plot(batches, [row[f"{name}_tok_s"] for row in mine], style, marker="s", color=f"C{i + 1}",
                    label=f"{name.replace('_tau', ', τ ')}, prompt {prompt_len}")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens / s",
           title="8B-shaped target on one GPU: decoding speed against batch size")
    finish_plot(fig, ax, path)


def plot_adaptive_widths(rows: list[dict], path) -> None:
    """Adaptive verification's mean chosen width against batch size, beside the best fixed K of the envelope
    (--fixed-k) at each batch: the budget the cost curve and the estimates chose as the batch grows."""
    fig, ax = new_plot()
    names = sorted({key[:-len("_adaptive_width")] for row in rows for key in row if key.endswith("_adaptive_width")})
    for i, name in enumerate(names):
        mine = sorted((row for row in rows if f"{name}_adaptive_width" in row), key=lambda row: row["B"])
        method = name.split("_tau")[0]
        ax.plot([row["B"] for row in mine], [row[f"{name}_adaptive_width"] for row in mine], marker="o",
                color=f"C{i}", label=f"{name.replace('_tau', ', τ ')}: adaptive, mean width")
        # K 0 (no speculation best: drafting alone costs a step) is a point too.
        best = [(row["B"], row[f"{method}_best_fixed_K"]) for row in mine
                if row.get(f"{method}_best_fixed_K") is not None]
        if best:
            ax.plot(*zip(*best), linestyle="none", marker="x", markersize=9, color=f"C{i}",
                    label=f"{method}: best fixed K (--fixed-k envelope)")
    ax.set(xscale="log", xlabel="batch size", ylabel="drafts verified per step",
           title="Adaptive verification: the budget chosen against batch size")
    finish_plot(fig, ax, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(benchmarking.SHAPES), default="8b")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--prompt-lens", default="128,1024")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--acceptance-lengths", default="4.0")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--methods", default="eagle",
                        help="drafters to time: eagle, eagle_fr, eagle3, draft_model, dflash, dflash_fr, mtp "
                             "(with --shape mimo7b: MiMo-7B and one MTP module)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default="bench_decode")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="weights and compute; float32 also multiplies in float32 (not TF32)")
    parser.add_argument("--plot", nargs="+", metavar="JSON", default=None,
                        help="only draw the batch-scaling plot from these results files (into the first's folder)")
    parser.add_argument("--tree-nodes", type=int, default=0,
                        help="EAGLE drafters draft dynamic trees of this many nodes (depth K); 0: chains")
    parser.add_argument("--tree-top-k", type=int, default=8, help="top-k of the dynamic trees")
    parser.add_argument("--draft-logit-scale", type=float, default=1.0,
                        help="multiplies the EAGLE-3 head's LM head: confident drafts, deep trees (module docstring)")
    parser.add_argument("--acceptance-rates", default=None,
                        help="a per-position acceptance profile (unconditional rates, non-increasing) instead of "
                             "--acceptance-lengths")
    parser.add_argument("--adaptive", action="store_true",
                        help="also run every case with adaptive verification (enable_adaptive_verification)")
    parser.add_argument("--with-widest-runs", action="store_true",
                        help="with --adaptive, also run it with steps held at K in a loop of their own "
                             "(speculative_loop's widest_runs): columns 'widest runs'")
    parser.add_argument("--fixed-k", default=None,
                        help="also time every drafter at each of these fixed K (the envelope adaptive is held to)")
    parser.add_argument("--model-parallel", type=int, default=1,
                        help="split the models over this many GPUs (specjax.sharding, model axis); above 1, "
                             "greedy outputs are also compared with one GPU's")
    args = parser.parse_args()
    if args.plot:
        import json
        import pathlib

        rows = [row for path in args.plot for row in json.loads(pathlib.Path(path).read_text())["rows"]]
        plot_batch_scaling(rows, pathlib.Path(args.plot[0]).with_name("bench_decode_batch_scaling.png"))
        if any(key.endswith("_adaptive_width") for row in rows for key in row):
            plot_adaptive_widths(rows, pathlib.Path(args.plot[0]).with_name("bench_decode_adaptive_widths.png"))
        return
    batches = [int(b) for b in args.batches.split(",")]
    prompt_lens = [int(p) for p in args.prompt_lens.split(",")]
    methods = args.methods.split(",") if args.methods else []
    num_draft, new_tokens = args.num_speculative_tokens, args.new_tokens
    rates = None if args.acceptance_rates is None else tuple(float(r) for r in args.acceptance_rates.split(","))
    if rates is not None and len(rates) < num_draft:
        raise SystemExit(f"--acceptance-rates has {len(rates)} rates: allowed at least K = {num_draft}")
    taus = ([round(1 + sum(rates[:num_draft]), 4)] if rates is not None
            else [float(t) for t in args.acceptance_lengths.split(",")])
    tree = dict(total_tokens=args.tree_nodes, tree_top_k=args.tree_top_k) if args.tree_nodes else {}
    lookahead = (args.tree_nodes or num_draft) + 1
    envelope = [int(k) for k in args.fixed_k.split(",")] if args.fixed_k else []
    if envelope and (rates is None or max(envelope) > len(rates)):
        raise SystemExit(f"--fixed-k {args.fixed_k!r}: needs --acceptance-rates with at least max(K) rates")
    if args.adaptive and tree:
        raise SystemExit("--adaptive: adaptive verification cuts chains, not the trees of --tree-nodes")
    if tree and set(methods) - {"eagle", "eagle_fr", "eagle3"}:
        raise SystemExit(f"--tree-nodes: dynamic trees are drafted by eagle, eagle_fr and eagle3, not {args.methods!r}")

    bandwidths = [benchmarking.copy_bandwidth()]
    print(f"copy bandwidth {bandwidths[0] / 1e12:.2f} TB/s")
    target_config, draft_config = (dataclasses.replace(c, param_dtype=args.dtype, dtype=args.dtype)
                                   for c in benchmarking.SHAPES[args.shape])
    if args.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "float32")
    parallel = args.model_parallel
    unknown = set(methods) - set(DRAFTERS)
    if unknown:
        raise SystemExit(f"--methods {args.methods!r}: {sorted(unknown)} unknown; allowed {', '.join(DRAFTERS)}")
    target = build_target(target_config, parallel)
    drafters = {method: build_drafter(method, target_config, draft_config, parallel) for method in methods}
    if args.draft_logit_scale != 1.0:
        if methods != ["eagle3"]:
            raise SystemExit("--draft-logit-scale scales the EAGLE-3 head's own LM head: use it with --methods eagle3")
        drafters["eagle3"].lm_head.set_value(drafters["eagle3"].lm_head[...] * args.draft_logit_scale)
    mesh = sharding.make_mesh(1, parallel)
    cases = [(p, b, cache_size_for(p, new_tokens, lookahead - 1)) for p in prompt_lens for b in batches]
    # One GPU's greedy tokens (autoregressive, and speculative with the first method and tau), to compare with.
    reference = {}
    if parallel > 1:
        for prompt_len, batch, cache_size in cases:
            reference[prompt_len, batch] = [np.asarray(state.tokens) for state in run_both(
                target, drafters, methods[:1], taus[:1], num_draft, cache_size,
                generation_args(target, batch, prompt_len, new_tokens, lookahead, cache_size), tree, rates)]
    one_gpu, target = target, sharding.shard(target, mesh)
    drafters = {name: sharding.shard(drafter, mesh) for name, drafter in drafters.items()}
    columns = [("gpus", "GPUs"), ("B", "B"), ("prompt", "prompt"), ("ar_step_ms", "AR ms/step"), ("ar_tok_s", "AR tok/s"),
               ("floor_tok_s", "floor tok/s"), ("ar_fraction_of_floor", "AR / floor"),
               ("t_ar_forward_s", "T_forward(1) s"), ("t_verify_s", "T_verify(N+1) s" if tree else "T_verify(K+1) s")]
    for method in methods:
        for tau in taus:
            columns += [(f"t_draft_{method}_s", f"T_draft {method} s"), (f"{method}_tau{tau}_tok_s", f"{method} τ={tau} tok/s"),
                        *([(f"{method}_tau{tau}_measured_tau", "τ measured")] if tree else []),
                        (f"{method}_tau{tau}_bound_tok_s", "bound tok/s"),
                        (f"{method}_tau{tau}_of_bound", "of bound"), (f"{method}_tau{tau}_speedup", "× AR"),
                        *([(f"{method}_tau{tau}_adaptive_tok_s", "adaptive tok/s"),
                           (f"{method}_tau{tau}_adaptive_width", "adaptive mean width"),
                           (f"{method}_tau{tau}_adaptive_widths_kept", "widths worth choosing"),
                           (f"{method}_tau{tau}_adaptive_width0_share", "steps at width 0"),
                           (f"{method}_tau{tau}_adaptive_vs_fixed", "adaptive / fixed K"),
                           (f"{method}_tau{tau}_adaptive_step_predicted_ms", "step ms predicted"),
                           (f"{method}_tau{tau}_adaptive_step_measured_ms", "step ms measured"),
                           (f"{method}_tau{tau}_adaptive_steps", "adaptive steps")]
                          if args.adaptive else []),
                        *([(f"{method}_tau{tau}_widest_runs_adaptive_tok_s", "widest runs: tok/s"),
                           (f"{method}_tau{tau}_widest_runs_adaptive_step_measured_ms", "widest runs: step ms")]
                          if args.adaptive and args.with_widest_runs else []),
                        *(column for k in envelope for column in ((f"{method}_K{k}_tok_s", f"K={k} tok/s"),
                                                                   (f"{method}_K{k}_steps", f"K={k} steps"),
                                                                   (f"{method}_K{k}_step_ms", f"K={k} step ms"))),
                        *([(f"{method}_K{num_draft}_steps", f"K={num_draft} steps"),
                           (f"{method}_K{num_draft}_step_ms", f"K={num_draft} step ms")] if envelope else []),
                        *([(f"{method}_best_fixed_K", "best fixed K"), (f"{method}_adaptive_vs_best", "adaptive / best")]
                          if envelope else [])]
    if parallel > 1:
        columns += [("ar_step_collectives", "AR collectives/step"),
                    *((f"{method}_step_collectives", f"{method} collectives/step") for method in methods),
                    ("greedy_equal_one_gpu", "greedy = 1 GPU"), ("first_difference", "first differing token"),
                    ("logit_gap_at_difference", "logit gap there")]
    meta = {**benchmarking.environment(), "shape": args.shape, "dtype": args.dtype,
            "target": dataclasses.asdict(target_config),
            "draft": dataclasses.asdict(draft_config), "new_tokens": new_tokens, "K": num_draft,
            "tree_nodes": args.tree_nodes or None, "tree_top_k": args.tree_top_k if tree else None,
            "draft_logit_scale": args.draft_logit_scale, "acceptance_rates": rates, "adaptive": args.adaptive,
            "with_widest_runs": args.with_widest_runs,
            "fixed_k": envelope}
    rows = []
    with jax.set_mesh(mesh):
        for prompt_len, batch, cache_size in cases:
            row = {"B": batch, "prompt": prompt_len, "new": new_tokens, "K": num_draft, "cache": cache_size,
                   "gpus": parallel}
            run_args = sharding.put(generation_args(target, batch, prompt_len, new_tokens, lookahead, cache_size), mesh)
            one_args = sharding.put(generation_args(target, batch, prompt_len, 1, lookahead, cache_size), mesh)
            if reference:
                outputs = [sharding.to_host(state.tokens) for state in run_both(
                    target, drafters, methods[:1], taus[:1], num_draft, cache_size, run_args, tree, rates)]
                row["greedy_equal_one_gpu"] = all(np.array_equal(a, b) for a, b in
                                                  zip(outputs, reference[prompt_len, batch], strict=True))
                # Where the first differing token is, counted in generated tokens (None when all agree),
                # and how far apart one GPU's logits put the two tokens there: a gap at rounding level
                # is a near-tie that summation order decides, not a wrong result.
                differing = [first_difference(one_gpu, a, b) for a, b in zip(outputs, reference[prompt_len, batch])
                             if not np.array_equal(a, b)]
                row["first_difference"] = min(d[0] for d in differing) - prompt_len if differing else None
                row["logit_gap_at_difference"] = max(d[1] for d in differing) if differing else None
            ar_tok_s, t_prefill = tokens_per_s(autoregressive_run(target, cache_size), run_args, one_args)
            if parallel > 1:  # what a step waits for: its collectives, counted in the compiled loops
                row["ar_step_collectives"] = step_collectives(target, None, None, cache_size, run_args)
                for method in methods:
                    row[f"{method}_step_collectives"] = step_collectives(
                        target, drafters[method], synthetic_spec(method, taus[0], num_draft, rates=rates, **tree),
                        cache_size, run_args)
            context = prompt_len + new_tokens / 2
            # Per GPU: each reads its 1 / parallel of the weights and of the KV heads.
            floor_bytes = (benchmarking.weight_bytes(target, target_config, batch)
                           + benchmarking.kv_bytes(target_config, batch, context)) / parallel
            row.update(ar_step_ms=batch / ar_tok_s * 1e3, ar_tok_s=ar_tok_s, floor_bytes=floor_bytes,
                       prefill_ms=t_prefill * 1e3)
            row.update(component_times(target, drafters, batch, int(context), num_draft, cache_size,
                                       args.tree_nodes, args.tree_top_k))
            for method in methods:
                t_draft = row[f"t_draft_{method}_s"]
                for tau in taus:
                    # As for autoregressive: the full run minus a one-token run (same program).
                    spec = synthetic_spec(method, tau, num_draft, rates=rates, **tree)
                    spec_tok_s, _ = tokens_per_s(speculative_run(target, drafters[method], spec, cache_size),
                                                 run_args, one_args)
                    if tree:  # how long the first-ranked paths let the accepted ones be
                        state = speculative_run(target, drafters[method], spec, cache_size, final_state=True)(run_args)
                        row[f"{method}_tau{tau}_measured_tau"] = AcceptanceMetrics.from_counters(
                            state.counters, batch).summary()["mean_acceptance_length"]
                    # DFlash drafts the block in one forward; the chain drafters take K steps; one MTP
                    # module runs its window of K + 1 entries (the first draft), then K - 1 steps.
                    draft_steps = 1 if method.startswith("dflash") else num_draft
                    draft_time = draft_steps * t_draft
                    if method == "mtp":
                        draft_time = row["t_draft_mtp_window_s"] + (num_draft - 1) * t_draft
                    bound_tok_s = batch * tau / (row["t_verify_s"] + draft_time)
                    row[f"{method}_tau{tau}_tok_s"] = spec_tok_s
                    row[f"{method}_tau{tau}_bound_tok_s"] = bound_tok_s
                    row[f"{method}_tau{tau}_of_bound"] = spec_tok_s / bound_tok_s
                    row[f"{method}_tau{tau}_speedup"] = spec_tok_s / row["ar_tok_s"]
                    if args.adaptive:
                        row.update(adaptive_case(target, drafters[method], dataclasses.replace(
                            spec, enable_adaptive_verification=True), batch, cache_size, run_args, one_args,
                            f"{method}_tau{tau}", spec_tok_s))
                        if args.with_widest_runs:
                            row.update(adaptive_case(target, drafters[method], dataclasses.replace(
                                spec, enable_adaptive_verification=True), batch, cache_size, run_args, one_args,
                                f"{method}_tau{tau}_widest_runs", spec_tok_s, widest_runs=True))
                if envelope:  # the envelope: no speculation, K itself, and every fixed K asked for
                    fixed = {0: row["ar_tok_s"], num_draft: row[f"{method}_tau{taus[0]}_tok_s"]}
                    for k in [*envelope, num_draft]:  # K itself last: its tokens/s is the tau column's
                        spec = synthetic_spec(method, 1 + sum(rates[:k]), k, rates=rates)
                        if k not in fixed:
                            fixed[k] = row[f"{method}_K{k}_tok_s"] = tokens_per_s(
                                speculative_run(target, drafters[method], spec, cache_size), run_args, one_args)[0]
                        # Its steps and a step's time, against adaptive's at the same width.
                        _, row[f"{method}_K{k}_steps"], step_s = loop_steps(target, drafters[method], spec,
                                                                            cache_size, run_args, fixed[k])
                        row[f"{method}_K{k}_step_ms"] = None if step_s is None else step_s * 1e3
                    best = max(fixed, key=fixed.get)
                    row[f"{method}_best_fixed_K"] = best
                    if args.adaptive:
                        row[f"{method}_adaptive_vs_best"] = row[f"{method}_tau{taus[0]}_adaptive_tok_s"] / fixed[best]
            rows.append(row)
            bandwidths.append(benchmarking.copy_bandwidth())
            bandwidth = max(bandwidths)  # every row's floor against the highest so far
            meta.update(copy_bandwidth_TBps=round(bandwidth / 1e12, 3),
                        copy_bandwidth_samples_TBps=[round(b / 1e12, 3) for b in bandwidths])
            for done in rows:
                done.update(floor_tok_s=done["B"] * bandwidth / done["floor_bytes"],
                            ar_fraction_of_floor=done["floor_bytes"] / bandwidth / (done["ar_step_ms"] / 1e3))
            print({k: (f"{v * 1e3:.3f} ms" if k.startswith("t_") else round(v, 3) if isinstance(v, float) else v)
                   for k, v in row.items()}, flush=True)
            # After every case: a run cut short keeps what it measured.
            paths = benchmarking.write_results(args.name, rows, columns, meta, args.out_dir,
                                               notes=f"Copy bandwidth measured {len(bandwidths)} times in this run: "
                                               f"{min(bandwidths) / 1e12:.3f} to {bandwidth / 1e12:.3f} TB/s; the floor "
                                               "uses the highest.\n\n" + crossover_notes(rows, methods, taus, prompt_lens))

    print("wrote", *paths)


if __name__ == "__main__":
    main()

"""Where the adaptive engine's width-0 step spends the time it costs over decode_step (issue 39: at 256 requests the
adaptive DFlash engine chooses width 0 every step and stepped 12.92 ms against 11.94 for the engine without a
drafter on the H100, twenty-sixth session).

At the 8B shape (random weights), `--batch` greedy rows, caches half full (decoding.step_profile_loop's state):
decode_step; speculative_step held at width 0 (the engine's held visits at 256 requests: DFlash K 15, adaptive,
synthetic acceptance) whole, then with one of its parts taken out at a time by patching it away while the loop
compiles (the result is no longer decoding, only a timing): the drafter's context write (DFlash's accept_verified:
the committed position's target features into its cache; with it the forward's intermediate hidden states are
dead too), the estimator (its choice and its counts' update), both; and the switch's step forced to width 0 (what
a visit that is not held runs, decoding.step_seconds). Each row: the median device ms of a step inside one jitted
loop (benchmarking.time_in_loop), and its excess over decode_step.

    PYTHONPATH=. python benchmarks/probes/width0_step_parts.py [--shape 8b] [--batch 256] [--k 15]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
from unittest import mock

import jax
import jax.numpy as jnp

from specjax import adaptive, benchmarking, decoding
from specjax.config import SamplingConfig
from specjax.proposers import build_proposer
from specjax.proposers.dflash import DFlashProposer
from specjax.speed import build_drafter, build_target, cache_size_for, synthetic_spec
from specjax.verify import lossless_verifiers, method_index
from specjax.verify.sampling import GREEDY, SamplingParams

RATES = (0.691, 0.454, 0.327, 0.240, 0.182, 0.138, 0.116, 0.102, 0.082, 0.069, 0.061, 0.055, 0.050, 0.044, 0.041)


def no_context_write(self, params, state, num_accepted, next_token, target_out, context):
    """DFlash's accept_verified with its cache lengths moved and nothing written."""
    start = context.lengths - 1
    return dataclasses.replace(state, cache=state.cache.with_lengths(start + num_accepted + 1),
                               num_pending=jnp.zeros_like(state.num_pending))


PATCHES = {
    "no context write": lambda: [mock.patch.object(DFlashProposer, "accept_verified", no_context_write)],
    "no estimator": lambda: [mock.patch.object(adaptive, "choose_width", lambda *a: jnp.int32(0)),
                             mock.patch.object(adaptive.AdaptiveState, "observe", lambda self, *a: self)],
}
PATCHES["neither"] = lambda: PATCHES["no context write"]() + PATCHES["no estimator"]()


def lengths_of(state):
    return state.lengths if isinstance(state, decoding.DecodeState) else state.decode.lengths


def timed(step, weights, state, samples: int) -> float:
    """Median device ms of step(*weights, state) in a loop that carries the state; the weights are the loop's
    invariant arguments (closed over, they would be compiled in as constants)."""
    is_int = [not jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in jax.tree.leaves(state)]
    start = tuple(leaf for leaf, integer in zip(jax.tree.leaves(state), is_int) if integer)

    def run(weights, start, keep, state):
        leaves, treedef = jax.tree.flatten(state)
        given = iter(start)
        state = treedef.unflatten([jnp.where(keep, leaf, next(given)) if integer else leaf
                                   for leaf, integer in zip(leaves, is_int)])
        state = step(*weights, state)
        return lengths_of(state), (state,)

    result = benchmarking.time_in_loop(run, weights, start, jnp.bool_(False), state, invariant=3, carry=True,
                                       iterations=40, samples=samples, warmup=1)
    return 1e3 * result["median_s"]


class Rows(dict):
    """The step times, each printed as it lands (a call cut short keeps the rows it measured), with its excess over
    the first (decode_step's)."""

    def __setitem__(self, name: str, ms: float) -> None:
        super().__setitem__(name, ms)
        base = next(iter(self.values()))
        print(f"| {name} | {ms:.3f} ms | {ms - base:+.3f} ms ({100 * (ms / base - 1):+.1f}%) |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    target_config, draft_config = benchmarking.SHAPES[args.shape]
    model, weights = build_target(target_config), build_drafter("dflash", target_config, draft_config)
    spec = synthetic_spec("dflash", 0.0, args.k, rates=RATES, adaptive=True)
    cache_size = cache_size_for(128, 128, args.k)
    proposer = build_proposer(spec, GREEDY, cache_size, weights)
    bound = proposer.bind(weights, model)
    batch, prompt_len = args.batch, cache_size // 2
    tokens = jnp.arange(batch * prompt_len, dtype=jnp.int32).reshape(batch, prompt_len) % target_config.vocab_size
    lengths, budgets = jnp.full((batch,), prompt_len, jnp.int32), jnp.full((batch,), args.k + 2, jnp.int32)
    keys = jax.vmap(jax.random.key)(jnp.arange(batch))
    sampling = jax.tree.map(jnp.asarray, SamplingParams.of([SamplingConfig()] * batch, batch))
    print(f"{args.shape}, batch {batch}, DFlash K {args.k}, cache {cache_size} (half full), {jax.devices()[0]}")
    rows = Rows()

    plain = jax.jit(functools.partial(decoding.prefill, mode=GREEDY, eos_token_ids=(), cache_size=cache_size,
                                      cache_dtype=None))(model, tokens, lengths, budgets, keys, sampling)[0]
    rows["decode_step (no speculation)"] = timed(
        lambda model, state: decoding.decode_step(model, state, mode=GREEDY, eos_token_ids=()), (model,), plain,
        args.samples)
    del plain
    spec_state = jax.jit(functools.partial(decoding.speculative_init, proposer=proposer, eos_token_ids=()))(
        model, bound, tokens, lengths, budgets, keys, sampling)
    held = functools.partial(decoding.speculative_step, method=jnp.int32(method_index(spec)),
                             proposer=proposer, verifiers=lossless_verifiers(spec), eos_token_ids=(), hold=0)
    rows["held at width 0"] = timed(held, (model, bound), spec_state, args.samples)
    for name, patches in PATCHES.items():
        with contextlib.ExitStack() as stack:
            for patch in patches():
                stack.enter_context(patch)
            rows[f"held at width 0, {name}"] = timed(held, (model, bound), spec_state, args.samples)
    del spec_state
    forced = adaptive.forced_costs(spec.verify_widths, 0)
    rows["the switch, forced to width 0"] = 1e3 * decoding.step_seconds(model, bound, proposer, batch, [forced])[0]
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(environment=benchmarking.environment(), shape=args.shape, batch=batch, k=args.k,
                           cache_size=cache_size, ms=rows), handle, indent=1)


if __name__ == "__main__":
    main()

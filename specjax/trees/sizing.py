"""`SpecConfig.total_tokens: auto`: the dynamic tree's size chosen for the device, the batch and the drafter.

A step of n nodes emits tau(n) tokens in T_verify(n + 1) + T_rest(n) seconds: the target's forward over the
root and the nodes, and the rest of the step (the drafter's depth levels, which expand tree_top_k nodes a level
whatever the size, and the tree's selection, masks, verification and cache moves, which grow with it).
The size picked is the candidate (SpecConfig.auto_tree_sizes) of highest tau(n) / (T_verify(n + 1) +
T_rest(n)), with

- T_verify(n + 1) measured on the device for every candidate: the target's forward under a tree mask, at
  the request's batch and cache size (`verify_seconds`);
- T_rest(n): measured steps of calibration runs at the smallest and the largest candidate, less their
  T_verify, and linear in n between them;
- tau(n) estimated from the drafter's own confidence, as EAGLE-2 (arXiv 2406.16858) observes that a path's
  draft probability approximates its acceptance rate: 1 + the sum of exp(path log-probability) over the n
  best nodes (the tree of n nodes keeps exactly those: `structure.grow`), scaled so that the largest
  candidate's estimate equals the calibration run's measured mean acceptance length (the shape of the
  curve from the drafter, its level from the target).

`specjax.trees.choose_tree_size`, which `generate` calls, runs the calibration (a few steps of the
request's own prompts) and `choose` picks; `TreeSizeChoice.table()` shows the figures it rests on.
EAGLE's `total_token=-1` measures the same forward times but weighs them with a fixed prior curve of
acceptance; Sequoia sizes trees for the hardware from an offline acceptance profile.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import benchmarking, sharding
from specjax.config import SpecConfig
from specjax.metrics import AcceptanceMetrics
from specjax.models.transformer import Transformer
from specjax.trees import masks, structure

REPEATS = 5  # timed forwards per candidate (the median is kept), calibration runs (the fastest)
CALIBRATION_TOKENS = 32  # tokens per row of the calibration run (fewer where a row's budget is smaller)


@dataclasses.dataclass(frozen=True)
class TreeSizeChoice:
    """What `auto` chose and why: per candidate size, the estimated mean acceptance length, the measured
    target forward over size + 1 positions, and the predicted tokens a second (batch rows)."""

    total_tokens: int
    sizes: tuple[int, ...]
    acceptance: tuple[float, ...]
    verify_s: tuple[float, ...]
    rest_s: tuple[float, ...]  # the rest of a step at each size
    batch: int

    @property
    def predicted_tok_s(self) -> tuple[float, ...]:
        return tuple(self.batch * tau / (t + r) for tau, t, r in zip(self.acceptance, self.verify_s, self.rest_s))

    def table(self) -> str:
        lines = [f"total_tokens auto: {self.total_tokens} (batch {self.batch})",
                 "| nodes | estimated τ | T_verify(nodes + 1) ms | T_rest ms | predicted tok/s |", "|---|---|---|---|---|"]
        lines += [f"| {'**' + str(n) + '**' if n == self.total_tokens else n} | {tau:.2f} | {t * 1e3:.2f} | "
                  f"{r * 1e3:.2f} | {tok:.0f} |" for n, tau, t, r, tok in
                  zip(self.sizes, self.acceptance, self.verify_s, self.rest_s, self.predicted_tok_s)]
        return "\n".join(lines)


def estimated_acceptance(log_probs: np.ndarray, sizes: Sequence[int], measured: float) -> list[float]:
    """Mean acceptance length of the tree of each size, from the path log-probabilities of the largest
    tree's nodes ([B, N], highest first; rows averaged) scaled to the measured mean acceptance length at N."""
    expected = 1.0 + np.cumsum(np.exp(np.asarray(log_probs, np.float64)), axis=1).mean(axis=0)  # [N]
    scale = (measured - 1.0) / (expected[-1] - 1.0) if expected[-1] > 1.0 else 1.0
    return [float(1.0 + scale * (expected[size - 1] - 1.0)) for size in sizes]


@jax.jit
def tree_verify_forward(model, cache, tokens, parents):
    """The loop's verification forward over [root, nodes] under the tree's mask (logits only)."""
    positions = masks.block_positions(parents, cache.lengths)
    mask = masks.tree_mask(parents)
    logits, _, _ = model(tokens, positions, cache, attention_mask=mask)
    return logits


def verify_seconds(model, cache, sizes: Sequence[int], repeats: int = REPEATS) -> list[float]:
    """Median device seconds of the target's forward over [root, size nodes] at each size, under a tree
    mask (a chain's: the mask's contents do not change the work) on `cache` (its batch and length).
    Compiled once per shape for the process (a module-level jit), not once per call."""
    batch = cache.lengths.shape[0]
    seconds = []
    for size in sizes:
        tokens = jnp.zeros((batch, size + 1), jnp.int32)
        parents = structure.chain_parents(batch, size)
        # Calls back to back, one wait a sample: dispatch overlaps the device's work, as in the loop.
        timing = benchmarking.time_call(tree_verify_forward, model, cache, tokens, parents, calls_per_sample=repeats,
                                        samples=repeats)
        seconds.append(timing["median_s"])
    return seconds


def choose(sizes: Sequence[int], acceptance: Sequence[float], verify_s: Sequence[float],
           step_s: tuple[float, float], batch: int) -> TreeSizeChoice:
    """The size of highest acceptance / (T_verify + T_rest), where T_rest is the measured step less its
    T_verify at the smallest and the largest size (step_s), linear in the size between them."""
    ends = [max(step - verify_s[i], 0.0) for step, i in zip(step_s, (0, -1))]
    span = max(sizes[-1] - sizes[0], 1)
    rest = [ends[0] + (ends[1] - ends[0]) * (size - sizes[0]) / span for size in sizes]
    rates = [tau / (t + r) for tau, t, r in zip(acceptance, verify_s, rest)]
    return TreeSizeChoice(total_tokens=sizes[int(np.argmax(rates))], sizes=tuple(sizes), acceptance=tuple(acceptance),
                          verify_s=tuple(verify_s), rest_s=tuple(rest), batch=batch)


def choose_tree_size(run, model: Transformer, spec: SpecConfig, batch: int) -> TreeSizeChoice:
    """total_tokens 'auto' (module docstring): calibration runs of the request at the smallest and the
    largest candidate size (each the fastest of REPEATS runs of CALIBRATION_TOKENS tokens a row, less the
    fastest of one token a row, so that neither the prefill nor the compile counts), the largest tree's
    drafts' confidences and measured acceptance, and the target's forward timed at every candidate size.
    run(spec, max_new_tokens=n) -> (SpecState, proposer), as run_speculative with the request bound."""
    sizes = spec.auto_tree_sizes

    def calibrate(size):
        def timed(max_new_tokens):
            start = time.perf_counter()
            state, proposer = run(dataclasses.replace(spec, total_tokens=size), max_new_tokens=max_new_tokens)
            return jax.block_until_ready(state), proposer, time.perf_counter() - start

        timed(1)  # compiles
        # The first run of each budget is slower (allocation): the fastest of a few runs counts.
        short, _, short_s = min((timed(1) for _ in range(REPEATS)), key=lambda timing: timing[2])
        state, proposer, long_s = min((timed(CALIBRATION_TOKENS) for _ in range(REPEATS)),
                                      key=lambda timing: timing[2])
        steps = int(state.counters.steps.max()) - int(short.counters.steps.max())
        return state, proposer, (long_s - short_s) / max(steps, 1)

    state, proposer, largest_step_s = calibrate(sizes[-1])
    measured = AcceptanceMetrics.from_counters(state.counters, batch).summary()["mean_acceptance_length"]
    log_probs = np.asarray(sharding.to_host(proposer.tree_log_probs(state.proposer)))[:batch]
    acceptance = estimated_acceptance(log_probs, sizes, measured)
    verify_s = verify_seconds(model, state.decode.cache, sizes)
    smallest_step_s = calibrate(sizes[0])[2] if len(sizes) > 1 else largest_step_s
    return choose(sizes, acceptance, verify_s, (smallest_step_s, largest_step_s), batch)

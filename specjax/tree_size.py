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
  best nodes (the tree of n nodes keeps exactly those: `draft_tree.grow`), scaled so that the largest
  candidate's estimate equals the calibration run's measured mean acceptance length (the shape of the
  curve from the drafter, its level from the target).

`specjax.decoding.choose_tree_size`, which `generate` calls, runs the calibration (a few steps of the
request's own prompts) and `choose` picks; `TreeSizeChoice.table()` shows the figures it rests on.
EAGLE's `total_token=-1` measures the same forward times but weighs them with a fixed prior curve of
acceptance; Sequoia sizes trees for the hardware from an offline acceptance profile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import benchmarking, draft_tree

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
    positions = draft_tree.block_positions(parents, cache.lengths)
    mask = draft_tree.tree_mask(parents)
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
        parents = draft_tree.chain_parents(batch, size)
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

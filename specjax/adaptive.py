"""Adaptive verification (vLLM's `enable_adaptive_verification`): how many drafts each step verifies.

Every step the loop drafts K tokens a row and then chooses, before the target sees them, the verify width W
out of the compiled widths (SpecConfig.verify_widths) that maximises expected tokens per second:

    rate(W) = (active rows + sum over rows of sum_{i <= W} survival[b, i]) / cost(W)
    survival[b, i] = prod_{j <= i} c[b, j]

c[b, j] is the estimated probability that row b's draft j is accepted given draft j - 1 was: DSpark's
confidence head where the drafts are deterministic, else AdaptiveState's estimate, kept in the loop's state.
That is empirical Bayes over the active rows: each row keeps discounted counts, by position, of the steps that
tested its draft j and of those it passed; the batch pools them, with the pooled rate of the shallower positions
as the prior of a position it has tested little or not lately (conditional acceptance is roughly flat or rising
with depth); and each row's estimate is its own counts under a Beta prior of mean the batch's. Before any test
the prior is a good drafter's (every draft 0.8 likely given the one before), so where verifying costs little (a
small batch) the first step verifies the whole block and sees every depth, and where it costs a step (a large
batch) it verifies what such a drafter would pay for. A row's estimate thus
starts at its batch mates' (a request the engine admits learns nothing from scratch), follows its own outcomes
after a few tests, and a position the width stopped verifying falls back to the batch's view, not to the prior
(benchmarks/probes/adaptive_policy_sim.py replays it on measured cost curves; docs/performance.md has figures).

Width 0 verifies no draft: the step is the target's one-position forward, an autoregressive step. A drafter that
can skip drafting (Proposer.skips_drafting: every chain drafter) then drafts nothing: the width is
chosen twice, first before drafting from the counts alone (a confidence head is not read yet), and if that choice
is 0 the drafter only idles (Proposer.idle: it writes the last step's features to its cache), so that where drafting
costs more than it returns (a large batch) the loop runs at autoregressive speed instead of paying the drafter for
nothing; otherwise it drafts and the width is chosen again with the drafter's confidence where it has one. While
it skips, the discounted counts fade toward the prior and a later step drafts again to test it. Where no
confidence is read, the width chosen before drafting is the step's: the drafter is told it (Context.verified), and
one that drafts_to_width computes only those drafts (DFlash: its LM head over the first W positions of its block).

cost(W) is a step's seconds at this batch and width, from a cost curve (CostCurve): measured on the device once
per model, drafter, shape, batch and device and kept on disk, or analytic on the CPU. The target then runs one forward over W + 1 positions (a `lax.switch` over the
compiled widths: a program's shapes are static) and every active row verifies its first W drafts.

Why one width for the batch rather than vLLM's per-row budget: vLLM packs each row's verified tokens into a
ragged batch, so its cost grows with the total tokens and a row's extra draft costs a token. Here the
forward is a padded [B, W + 1] block: its cost depends on W alone, and verifying more of a row's drafts
within W never lowers its expected tokens. Per-row masks (the verifiers' num_valid) therefore cut nothing
at a fixed width; they carry the choice into the verifiers.

Lossless whatever the choice, as long as it is made before the target's scores are seen and from nothing
the row's own sampled drafts decide (the counts are of past steps' outcomes, the batch's included): a rule run on a w-draft chain is lossless for any w fixed by the past,
but a width chosen by looking at sampled drafts (their probabilities, or a confidence head that reads them)
conditions the draft and biases the output (tests/test_adaptive.py's negative control). So the confidence
head is read only when drafts are deterministic (draft_sample_method 'greedy').
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from specjax.config import SpecConfig

log = logging.getLogger("specjax.adaptive")

# A step's weight in the counts against the step before's: a row's outcomes count for about its last
# 1 / (1 - DISCOUNT) = 10 steps, so estimates follow a request whose text changes and untested positions forget.
DISCOUNT = 0.9
# A row's prior for position i is Beta with mean the batch's estimate and this many pseudo-tests: a row's own
# record outweighs its batch mates' after a few tests of that position, and a new row starts at the batch's.
ROW_PRIOR_TESTS = 4.0
# The batch's estimate of position i has as its prior the batch's pooled rate over positions 1..i-1:
# conditional acceptance is roughly flat or rising with depth, so a position no row tested lately is about as
# likely as the shallower ones (a pool: less noisy than the one position above it, which a row may have seen once).
# Before any test the prior is PRIOR, a good drafter's rate, and a batch that stopped testing drifts back to it.
# Certainty (1, vLLM's verifying fully until its estimator is fitted) made a large batch's first step verify all
# K drafts at K + 1 positions' cost, and its skipping steps explore too often; at 0.7 a batch of 64 whose drafter
# would pay (τ 5.7) never tested it (benchmarks/probes/adaptive_policy_sim.py; docs/performance.md).
PRIOR = 0.8
# The weight of each of those priors in pseudo-tests: it fills a position nobody tested lately, and the batch's
# first tests outweigh it.
PRIOR_TESTS = 1.0


@functools.partial(jax.tree_util.register_dataclass, data_fields=("passed", "tested", "chosen"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class AdaptiveState:
    """Each row's discounted counts, by draft position i = 1..K, of steps that tested draft i (verified it
    with every draft before it accepted) and of those where it passed, kept in the loop. Every field has the
    batch axis: the engine moves and resets rows with their counts."""

    passed: Float[Array, "B K"]
    tested: Float[Array, "B K"]
    # The index in spec.verify_widths the row's last step chose (or, in a step told to verify a held width, would
    # have chosen); -1 where it was done. What ends a held visit or run (the engine's docstring, "held visits").
    chosen: Int[Array, " B"]

    @classmethod
    def init(cls, batch: int, num_draft: int) -> AdaptiveState:
        return cls(passed=jnp.zeros((batch, num_draft), jnp.float32),
                   tested=jnp.zeros((batch, num_draft), jnp.float32), chosen=jnp.full((batch,), -1, jnp.int32))

    def observe(self, active: Bool[Array, " B"], verified: Int[Array, " B"],
                accepted: Int[Array, " B"]) -> AdaptiveState:
        """After a step that verified `verified` drafts of each row and accepted `accepted`: draft i was
        tested where i <= verified and every draft before it was accepted (i <= accepted + 1), and passed
        where i <= accepted. An active row's counts are discounted, then counted; a done row's are kept."""
        position = jnp.arange(1, self.passed.shape[1] + 1)[None, :]
        tested = (position <= verified[:, None]) & (position <= accepted[:, None] + 1)
        passed = position <= accepted[:, None]
        step = active[:, None]
        return dataclasses.replace(self, passed=jnp.where(step, DISCOUNT * self.passed + passed, self.passed),
                                   tested=jnp.where(step, DISCOUNT * self.tested + tested, self.tested))

    def batch_estimate(self, active: Bool[Array, " B"]) -> Float[Array, " K"]:
        """The active rows' pooled estimate of P(draft i accepted | draft i - 1 accepted): their counts summed,
        with the pooled rate over positions 1..i-1 (itself under the uniform prior) as a prior."""
        rows = active[:, None]
        passed = jnp.sum(jnp.where(rows, self.passed, 0.0), axis=0)
        tested = jnp.sum(jnp.where(rows, self.tested, 0.0), axis=0)
        above_passed, above_tested = jnp.cumsum(passed) - passed, jnp.cumsum(tested) - tested  # positions 1..i-1
        depth = (above_passed + PRIOR_TESTS * PRIOR) / (above_tested + PRIOR_TESTS)
        return (passed + PRIOR_TESTS * depth) / (tested + PRIOR_TESTS)

    def estimate(self, active: Bool[Array, " B"]) -> Float[Array, "B K"]:
        """Each row's posterior mean: its own counts with the batch's estimate as a prior of ROW_PRIOR_TESTS
        tests (empirical Bayes over the active rows)."""
        return (self.passed + ROW_PRIOR_TESTS * self.batch_estimate(active)[None, :]) / (self.tested + ROW_PRIOR_TESTS)


def conditional_acceptance(spec: SpecConfig, state: AdaptiveState, confidence: Float[Array, "B K"] | None,
                           active: Bool[Array, " B"]) -> Float[Array, "B K"]:
    """c[b, i]: the drafter's confidence head where it has one and its drafts are deterministic (greedy
    drafting: the drafts, hence the head, are functions of the committed tokens), else the counts' estimate.
    A sampled draft's confidence would make the width depend on the draft (the module's docstring)."""
    if reads_confidence(spec, confidence):
        return confidence.astype(jnp.float32)
    return state.estimate(active)


def reads_confidence(spec: SpecConfig, confidence: Float[Array, "B K"] | None) -> bool:
    """Whether conditional_acceptance reads the drafter's confidence (static: the width chosen from the counts
    alone, before drafting, is otherwise the step's)."""
    return confidence is not None and spec.draft_sample_method == "greedy"


def holds(state: AdaptiveState, index: int) -> Bool[Array, ""]:
    """Whether every row that stepped last chose (or would have chosen) the width at `index` of spec.verify_widths:
    what keeps a held visit (the engine's) or widest run (speculative_loop's) going."""
    return ~jnp.any((state.chosen >= 0) & (state.chosen != index))


def expected_tokens(conditional: Float[Array, "B K"], active: Bool[Array, " B"],
                    widths: Sequence[int]) -> Float[Array, " W"]:
    """Expected tokens the batch emits at each width: a token per active row plus the survivals of the
    drafts each verifies (sum over i <= W of prod_{j <= i} c[b, j])."""
    survival = jnp.cumprod(jnp.clip(conditional, 0.0, 1.0), axis=1) * active[:, None]
    accepted = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(jnp.sum(survival, axis=0))])
    return jnp.sum(active).astype(jnp.float32) + accepted[jnp.asarray(widths)]


def choose_width(conditional: Float[Array, "B K"], active: Bool[Array, " B"], widths: Sequence[int],
                 costs: Float[Array, " W"]) -> Int[Array, ""]:
    """The index in widths of the width with the most expected tokens per unit of cost (the first of equals:
    the narrowest)."""
    return jnp.argmax(expected_tokens(conditional, active, widths) / costs).astype(jnp.int32)


def padded(tree: Any, length: int) -> Any:
    """Every leaf's position axis (second from last: hidden [..., B, T, D]) padded with zeros to `length`: a
    narrow forward's outputs in the shape the loop's state keeps (Proposer.accept_verified's default). Nothing
    reads past the verified width."""
    def pad(x):
        if x.shape[-2] == length:
            return x
        widths = [(0, 0)] * x.ndim
        widths[-2] = (0, length - x.shape[-2])
        return jnp.pad(x, widths)

    return jax.tree.map(pad, tree)


# ------------------------------------------------------------------------------------------ cost curves

# The analytic curve, in units of one decode step of the target at batch 1: a forward reads the weights once
# (1) and computes over every scored token, which starts to cost about RIDGE_TOKENS tokens in (docs/performance.md
# measures a 16-position forward against one at the 8B shape); the drafter a fixed DRAFT_COST whatever the width.
RIDGE_TOKENS = 300.0
DRAFT_COST = 0.2
PROFILE_ITERATIONS = 10  # steps per timed loop when profiling (benchmarking.time_in_loop)
# Timed runs of each loop a width (their median) after one untimed run: the engine profiles 9 widths at each of its
# 9 slot counts at warm-up, ~1,100 steps a count, where time_in_loop's defaults (7 after 2) would run ~2,400.
PROFILE_SAMPLES = 3
# How a profile is timed, in the cache key: a change of it (2: a propose timed after an accept of every draft; 3: at
# each width for a drafter that drafts to it; 4: after the loop's accept_verified at that width; 5: the loop's own
# step, its width forced by the cost vector; 6: that step with none of its work dead) leaves the curves profiled
# before unread.
PROFILE_METHOD = 6
# A profiled time is a difference of two loops' times: on a busy host a tiny one can come out <= 0.
MIN_PROFILED_SECONDS = 1e-9
# A width's cost in a forced_costs vector where it is not the one forced: no expected tokens (at most the batch
# times K + 1) make it the choice against the forced width's cost of 1.
FORCED_OUT = 1e9
# The share of a step a compiled width must save against the next wider one the loop may choose, or it is never
# chosen (worth_choosing). A wider width accepts at least as many tokens on every draw, so dropping a width loses at
# most this share of a step where it was the best; a narrower saving is within a profile's noise (widths 10 and 15
# measured 6.77 and 6.69 ms at batch 1 on the H100), while the tokens an estimate's wrong narrowing loses are not
# (docs/performance.md, nineteenth session).
MIN_SAVING = 0.05


@dataclasses.dataclass(frozen=True)
class CostCurve:
    """Seconds (or any unit: only ratios matter) of one speculative step by batch and verify width."""

    batches: tuple[int, ...]  # increasing
    widths: tuple[int, ...]  # increasing drafts verified a row (the forward scores width + 1 positions)
    seconds: tuple[tuple[float, ...], ...]  # [batch][width]
    source: str = "analytic"  # 'analytic', or where and how it was profiled

    def __post_init__(self):
        shape = (len(self.batches), len(self.widths))
        if np.asarray(self.seconds, np.float64).shape != shape or not np.all(np.asarray(self.seconds) > 0):
            raise ValueError(f"CostCurve.seconds must be positive, one row of {shape[1]} widths per batch "
                             f"({shape[0]}): got {self.seconds!r}")
        for name in ("batches", "widths"):
            values = list(getattr(self, name))
            if values != sorted(set(values)) or not values:
                raise ValueError(f"CostCurve.{name} = {values!r} is invalid: allowed increasing integers")

    @classmethod
    def analytic(cls, batches: Sequence[int], widths: Sequence[int], ridge_tokens: float = RIDGE_TOKENS,
                 draft_cost: float = DRAFT_COST, skips_drafting: bool = False) -> CostCurve:
        """1 + tokens scored / ridge_tokens + draft_cost per step (the constants' comment); no draft_cost at width 0
        for a drafter that skips drafting there (Proposer.skips_drafting)."""
        def draft(w):
            return 0.0 if skips_drafting and w == 0 else draft_cost

        seconds = tuple(tuple(1.0 + b * (w + 1) / ridge_tokens + draft(w) for w in widths) for b in batches)
        return cls(tuple(batches), tuple(widths), seconds)

    def costs(self, batch: int, widths: Sequence[int]) -> np.ndarray:
        """A step's cost at each of `widths` for `batch` rows: the row of the smallest profiled batch that
        holds them (the largest if none does), linear between profiled widths, flat past the last."""
        index = next((i for i, b in enumerate(self.batches) if b >= batch), len(self.batches) - 1)
        return np.interp(np.asarray(widths, np.float64), self.widths, self.seconds[index]).astype(np.float32)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CostCurve:
        return cls(batches=tuple(data["batches"]), widths=tuple(data["widths"]),
                   seconds=tuple(tuple(row) for row in data["seconds"]), source=data["source"])


def cost_curve_dir() -> Path:
    """Where profiled cost curves are kept: $SPECJAX_COST_CURVE_DIR, else $XDG_CACHE_HOME/specjax/cost_curves
    (default ~/.cache/specjax/cost_curves)."""
    if os.environ.get("SPECJAX_COST_CURVE_DIR"):
        return Path(os.environ["SPECJAX_COST_CURVE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specjax" / "cost_curves"


def forced_costs(widths: Sequence[int], index: int) -> np.ndarray:
    """A cost vector under which choose_width picks widths[index] whatever the estimates: what a profile passes the
    loop to time its step at that width."""
    costs = np.full(len(widths), FORCED_OUT, np.float32)
    costs[index] = 1.0
    return costs


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """The loop whose step a profile times: what names it in the cache key (the drafter's method, K and weights'
    shapes) and its step's seconds at a batch under each of several cost vectors (forced_costs: one width each;
    e.g. specjax.decoding.step_timing)."""

    key: str
    seconds: Callable[[int, Sequence[np.ndarray]], list[float]]
    skips_drafting: bool = False  # width 0 drafts nothing (Proposer.skips_drafting): the analytic curve's case


def curve_key(model: Any, batch: int, widths: Sequence[int], cache_size: int, timing_key: str = "") -> str:
    """What a profile depends on: the device, JAX, the model's shape and dtype, the batch, widths and cache, the
    loop's key (its drafter), and how it is timed (PROFILE_METHOD)."""
    device = jax.devices()[0]
    leaf = jax.tree.leaves(model)[0]
    what = {"platform": device.platform, "device": device.device_kind, "jax": jax.__version__,
            "model": repr(model.config), "dtype": str(leaf.dtype), "layout": type(model.layers).__name__,
            "batch": batch, "widths": list(widths), "cache_size": cache_size, "drafter": timing_key,
            "method": PROFILE_METHOD}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def profile(batch: int, widths: Sequence[int], timing: StepTiming) -> CostCurve:
    """A step's seconds at each width: the loop's own step (drafting, the forward over W + 1 positions, the
    verifier, the commit, the estimator and the switch), its width forced by the cost vector. One program a batch
    serves every width, since the costs are data."""
    seconds = timing.seconds(batch, [forced_costs(widths, i) for i in range(len(widths))])
    device = jax.devices()[0]
    # A step too small to time (a tiny model on a busy CPU) can measure at or below zero: floored, not refused.
    return CostCurve((batch,), tuple(widths), (tuple(max(s, MIN_PROFILED_SECONDS) for s in seconds),),
                     source=f"profiled on {device.device_kind} ({device.platform}): the loop's step, its width forced")


def cached_profile(model: Any, batch: int, widths: Sequence[int], cache_size: int, timing: StepTiming,
                   directory: Path | None = None) -> CostCurve:
    """profile(...), measured once per model, shape, batch, widths, drafter and device, then read from disk."""
    key = curve_key(model, batch, widths, cache_size, timing.key)
    path = (directory or cost_curve_dir()) / f"{key}.json"
    if path.exists():
        return CostCurve.from_json(json.loads(path.read_text()))
    start = time.perf_counter()
    curve = profile(batch, widths, timing)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(curve.to_json(), indent=1))
    # Profiling compiles the loop's step at each batch: a minute at a large shape, so an operator sees why.
    log.info("profiled the step's cost at batch %d, widths %s in %.1f s; cached in %s", batch, list(widths),
             time.perf_counter() - start, path)
    return curve


def default_cost_curve(model: Any, batch: int, widths: Sequence[int], cache_size: int,
                       timing: StepTiming) -> CostCurve:
    """The cost curve adaptive verification uses when none is given: analytic on the CPU (whose timings say
    nothing of an accelerator's, and which the tests run on), profiled and cached elsewhere."""
    if jax.default_backend() == "cpu":
        return CostCurve.analytic((batch,), widths, skips_drafting=timing.skips_drafting)
    return cached_profile(model, batch, widths, cache_size, timing)


def worth_choosing(costs: np.ndarray, min_saving: float = MIN_SAVING) -> np.ndarray:
    """Which widths (increasing, K last) save at least min_saving of a step against the next wider one kept: the
    widest always, then each narrower in turn against the last kept."""
    keep, wider = np.ones(len(costs), bool), costs[-1]
    for i in range(len(costs) - 2, -1, -1):
        keep[i] = costs[i] <= (1.0 - min_saving) * wider
        wider = costs[i] if keep[i] else wider
    return keep


def verify_costs(spec: SpecConfig, curve: CostCurve | None, batch: int) -> Float[Array, " W"] | None:
    """The loop's argument: the curve's cost at each compiled width for this batch (None without adaptive
    verification), FORCED_OUT at a width not worth choosing (worth_choosing). Data, not a static argument, so that a
    new profile compiles nothing."""
    if not spec.enable_adaptive_verification:
        return None
    costs = curve.costs(batch, spec.verify_widths)
    return jnp.asarray(np.where(worth_choosing(costs), costs, np.float32(FORCED_OUT)))

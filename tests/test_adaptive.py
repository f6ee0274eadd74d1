"""Adaptive verification (SpecConfig.enable_adaptive_verification, specjax.adaptive): the budget argmax on
constructed curves, the estimator, cut verifiers equal to the verifiers of the cut chain (why any width chosen
before the target's scores keeps them lossless), cost curves on disk, bad settings refused; through the loop:
greedy output identical to autoregressive for a chain drafter, DFlash and DSpark in generate and in the engine
while the width changes from step to step, one while loop, and losslessness by chi-square with the negative
control of a width chosen from the row's own sampled draft."""

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.distributions import NUM_TOKENS, PROMPT, TINY, chi_square_pvalue, exact_joint, joint_counts_by_sampling, tiny_pair
from support.jaxpr import equations, primitives, speculative_loop_args
from support.models import EOS, dflash_config, head_for, mtp_modules, target_and_drafts, trained_dflash
from support.requests import autoregressive_outputs, ragged_requests

from specjax import adaptive, decoding
from specjax.config import ConfigError, SamplingConfig, SpecConfig
from specjax.decoding import generate, speculative_loop
from specjax.models.dflash import init_dflash
from specjax.proposers import Context, Proposer
from specjax.verify import block, greedy, standard, synthetic
from specjax.verify.common import make_draws, race_sample

T1 = SamplingConfig(temperature=1.0)


# ------------------------------------------------------------------------------------- the budget argmax

# The argmax as the loop runs it, in one program each (eagerly, every operation would compile a program of its own).
expected_tokens = jax.jit(adaptive.expected_tokens, static_argnums=2)
choose_width = jax.jit(adaptive.choose_width, static_argnums=2)


@pytest.mark.parametrize("acceptance, costs, expected", [
    (0.9, (1.0, 1.02, 1.04, 1.08, 1.16), 4),  # batch 1: a wider forward costs little, confident drafts: all
    (0.9, (1.0, 1.6, 2.2, 3.4, 5.8), 2),  # large batch: cost grows with the width; 1.9 / 1.6 < 2.71 / 2.2 > ...
    (0.3, (1.0, 1.6, 2.2, 3.4, 5.8), 0),  # unlikely drafts at that cost: verify none (one token per row)
    (0.3, (1.0, 1.05, 1.2, 1.5, 2.0), 1),  # the first draft pays (1.3 / 1.05), the second not (1.39 / 1.2)
])
def test_the_budget_argmax_picks_the_width_with_most_expected_tokens_per_cost(acceptance, costs, expected):
    """Widths (0, 1, 2, 4, 8), four rows of equal conditional acceptance: expected tokens at width W are
    rows * (1 + a + ... + a^W); the choice is the argmax of that over the cost, checked against numpy."""
    widths = (0, 1, 2, 4, 8)
    conditional = np.full((4, 8), acceptance, np.float32)
    active = np.ones(4, bool)
    tokens = np.array([4 * sum(acceptance ** i for i in range(w + 1)) for w in widths])
    np.testing.assert_allclose(expected_tokens(conditional, active, widths), tokens, rtol=1e-5)
    assert int(np.argmax(tokens / np.array(costs))) == expected
    assert int(choose_width(conditional, active, widths, np.asarray(costs, np.float32))) == expected


def test_the_budget_counts_active_rows_only_and_each_rows_own_survival():
    """Row 0 certain, row 1 never accepted, row 2 done: expected tokens are 2 rows + row 0's drafts."""
    conditional = np.asarray([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 1.0]], np.float32)
    active = np.asarray([True, True, False])
    np.testing.assert_allclose(expected_tokens(conditional, active, (0, 1, 3)), [2.0, 3.0, 5.0])
    # From a cost curve: batch 3 reads the row of batch 4; width 3 between the profiled 2 and 4.
    curve = adaptive.CostCurve(batches=(1, 4), widths=(0, 2, 4), seconds=((1, 1, 1), (1.0, 2.0, 4.0)))
    np.testing.assert_allclose(curve.costs(3, (0, 1, 3)), [1.0, 1.5, 3.0])
    costs = curve.costs(3, (0, 1, 3))
    assert int(choose_width(conditional, active, (0, 1, 3), costs)) == 0  # 2 / 1 = 3 / 1.5: the narrower
    assert int(choose_width(conditional, active, (0, 1, 3), costs * np.float32([1.01, 1, 1]))) == 1


def test_a_width_that_saves_too_little_against_a_wider_one_is_never_chosen():
    """The H100's batch-1 curve (DFlash K 15 at the 8B shape, 2026-12-06): widths 1 to 10 cost within 5% of width
    15's step (10 above it), so only 0 and 15 stay; a steep curve keeps every width. Priced out in the loop's costs,
    a narrow width that the estimates favour loses to the next kept one; its control, every width kept, takes it."""
    widths = (0, 1, 2, 3, 4, 5, 7, 10, 15)
    flat = np.asarray([5.35, 6.44, 6.41, 6.40, 6.53, 6.45, 6.52, 6.77, 6.69], np.float32)
    assert [w for w, keep in zip(widths, adaptive.worth_choosing(flat)) if keep] == [0, 15]
    steep = np.asarray([7.11, 11.75, 12.35, 13.38, 14.73, 16.29, 18.97, 26.05, 31.74], np.float32)  # batch 64's
    assert [w for w, keep in zip(widths, adaptive.worth_choosing(steep)) if keep] == [0, 2, 3, 4, 5, 7, 10, 15]
    assert adaptive.worth_choosing(flat, min_saving=0.0).tolist() == [True, False, False, True, False, True, True,
                                                                       False, True]  # cheaper than the next kept
    spec = SpecConfig(method="dflash", num_speculative_tokens=15, enable_adaptive_verification=True)
    assert spec.verify_widths == widths
    costs = adaptive.verify_costs(spec, adaptive.CostCurve((1,), widths, (tuple(map(float, flat)),)), 1)
    np.testing.assert_array_equal(np.asarray(costs) == adaptive.FORCED_OUT, ~adaptive.worth_choosing(flat))
    # One row whose drafts 1-3 are certain and the rest never pass: width 3 has the most tokens a second (4 / 6.40).
    conditional = np.asarray([[1.0] * 3 + [0.0] * 12], np.float32)
    assert widths[int(choose_width(conditional, np.ones(1, bool), widths, flat))] == 3
    assert widths[int(choose_width(conditional, np.ones(1, bool), widths, costs))] == 15


def test_the_estimator_counts_tested_positions_with_a_discount():
    state = dataclasses.replace(adaptive.AdaptiveState.init(3, 4), passed=np.ones((3, 4), np.float32),
                                tested=np.full((3, 4), 2.0, np.float32))
    # Row 0 verified 4 and accepted 1: position 1 passed, 2 failed, 3 and 4 untested. Row 1 verified 2 and
    # accepted both: 1 and 2 passed, 3 and 4 untested (not verified). Row 2 is done: unchanged.
    new = jax.jit(adaptive.AdaptiveState.observe)(state, np.asarray([True, True, False]), np.asarray([4, 2, 4]),
                                                  np.asarray([1, 2, 0]))
    d = adaptive.DISCOUNT
    np.testing.assert_allclose(new.passed, [[d + 1, d, d, d], [d + 1, d + 1, d, d], [1] * 4], rtol=1e-6)
    tested = [2 * d + 1, 2 * d + 1, 2 * d, 2 * d]
    np.testing.assert_allclose(new.tested, [tested, tested, [2] * 4], rtol=1e-6)


@functools.partial(jax.jit, static_argnames=("steps", "width"))
def observed(conditional, steps, width, seed=0):
    """The estimator's state after `steps` steps of rows whose draft i is accepted with probability
    conditional[b, i - 1] given draft i - 1 was, every row verifying `width` drafts (one program)."""
    batch, k = conditional.shape

    def step(state, key):
        passes = jax.random.uniform(key, (batch, k)) < conditional
        accepted = jnp.minimum(jnp.sum(jnp.cumprod(passes, axis=1), axis=1), width)
        return state.observe(jnp.ones(batch, bool), jnp.full(batch, width), accepted), None

    keys = jax.random.split(jax.random.key(seed), steps)
    return jax.lax.scan(step, adaptive.AdaptiveState.init(batch, k), keys)[0]


estimate = jax.jit(adaptive.AdaptiveState.estimate)
batch_estimate = jax.jit(adaptive.AdaptiveState.batch_estimate)
PROFILE = np.float32([0.7, 0.65, 0.75, 0.8, 0.85, 0.9])  # conditional acceptance rising with depth, as measured


def test_the_estimate_converges_to_the_profile_it_observes():
    """64 rows of one profile verified whole for 40 steps: the batch's estimate within 0.06 of the profile at
    every position (the deepest is tested about 13 times a step), the rows' within 0.1 root mean square (a row's
    own last steps are few: noisy), their mean within 0.06;
    a row that never saw a test starts at the batch's estimate."""
    state = observed(np.broadcast_to(PROFILE, (64, 6)), steps=40, width=6)
    active = np.ones(64, bool)
    np.testing.assert_allclose(batch_estimate(state, active), PROFILE, atol=0.06)
    rows = np.asarray(estimate(state, active))
    assert np.sqrt(np.mean((rows - PROFILE) ** 2)) < 0.1
    np.testing.assert_allclose(rows.mean(axis=0), PROFILE, atol=0.06)
    fresh = dataclasses.replace(state, passed=state.passed.at[0].set(0.0), tested=state.tested.at[0].set(0.0))
    np.testing.assert_allclose(estimate(fresh, active)[0], batch_estimate(fresh, active), rtol=1e-6)


def test_rows_of_a_mixed_batch_keep_their_own_estimates_and_done_rows_leave_the_pool():
    """Even rows accept 0.95 a position, odd rows 0.5: after 30 steps the even rows' estimates of the first
    position are above the odd rows' (by over 0.25 on average, each row beyond the other half's mean: a row's own
    record outweighs the batch's prior), and without the even rows (done) the batch's estimate is the odd rows'."""
    conditional = np.repeat(np.where(np.arange(32) % 2 == 0, 0.95, 0.5).astype(np.float32)[:, None], 4, axis=1)
    state = observed(conditional, steps=30, width=4)
    rows = np.asarray(estimate(state, np.ones(32, bool)))
    high, low = rows[0::2, 0], rows[1::2, 0]
    assert high.mean() > low.mean() + 0.25 and high.min() > low.mean() and low.max() < high.mean()
    odd = np.arange(32) % 2 == 1
    assert abs(float(batch_estimate(state, odd)[0]) - 0.5) < 0.1


def test_an_untested_position_is_neither_stuck_at_zero_nor_certain():
    """Rows that verified 2 drafts of a 0.6 profile for 40 steps: positions 3..6, never tested, take about the
    tested positions' rate. A position that always failed climbs back once the width stops testing it (steps that
    verify none: counts fade toward the prior)."""
    state = observed(np.full((16, 6), 0.6, np.float32), steps=40, width=2)
    active = np.ones(16, bool)
    assert np.all(np.abs(np.asarray(batch_estimate(state, active))[2:] - 0.6) < 0.1)
    assert np.all(np.abs(np.asarray(estimate(state, active))[:, 2:] - 0.6) < 0.15)
    failed = observed(np.zeros((16, 6), np.float32), steps=40, width=6)
    low = float(batch_estimate(failed, active)[0])
    assert low < 0.01
    idle = jax.jit(lambda s: jax.lax.fori_loop(0, 30, lambda _, s: s.observe(active, jnp.zeros(16, jnp.int32),
                                                                                jnp.zeros(16, jnp.int32)), s))
    later = float(batch_estimate(idle(failed), active)[0])
    assert 0.05 < later < 1.0 and later > 5 * low


def test_the_confidence_head_is_read_only_for_deterministic_drafts():
    state = adaptive.AdaptiveState.init(2, 3)
    confidence = np.full((2, 3), 0.25, np.float32)
    greedy_spec = SpecConfig(method="dspark", num_speculative_tokens=3, enable_adaptive_verification=True)
    sampled_spec = SpecConfig(method="dspark", num_speculative_tokens=3, enable_adaptive_verification=True,
                              draft_sample_method="probabilistic")
    active = np.ones(2, bool)
    assert (np.asarray(adaptive.conditional_acceptance(greedy_spec, state, confidence, active)) == 0.25).all()
    # Before any test, the estimate is the prior (PRIOR for every position).
    for spec, head in ((sampled_spec, confidence), (greedy_spec, None)):
        assert (np.asarray(adaptive.conditional_acceptance(spec, state, head, active)) == adaptive.PRIOR).all()


# ------------------------------------------------------------------- cut verifiers are the cut chain's verifiers

@functools.partial(jax.jit, static_argnames=("batch", "num_draft", "vocab", "seed"))
def random_block(batch=64, num_draft=4, vocab=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    target = jax.nn.softmax(2 * jax.random.normal(keys[0], (batch, num_draft + 1, vocab)), -1)
    draft = jax.nn.softmax(2 * jax.random.normal(keys[1], (batch, num_draft, vocab)), -1)
    tokens = jax.random.categorical(keys[2], jnp.log(draft))
    draws = make_draws(jax.random.split(keys[3], batch), num_draft, vocab)
    return target, tokens, draft, draws


RATES = (0.9, 0.7, 0.5, 0.2)  # the synthetic rule's, cut with the chain
RULES = {"standard": standard.verify_with_draws, "block": block.verify_with_draws,
         "greedy": lambda t, x, q, d, **cut: greedy.verify(t, x, q, **cut),
         "synthetic": lambda t, x, q, d, **cut: synthetic.verify_with_draws(t, x, q, d, rates=RATES[:x.shape[1]], **cut)}


@functools.partial(jax.jit, static_argnames="rule")
def cut_and_chains(rule, target, tokens, draft, draws, num_valid):
    """The rule on the block with each row cut to num_valid drafts, and on every row's chain of its first w drafts
    for w = 1..K (the same draws), in one program (eagerly, every operation would compile one of its own)."""
    verify = RULES[rule]
    chains = [verify(target[:, :w + 1], tokens[:, :w], None if draft is None else draft[:, :w],
                     type(draws)(uniforms=draws.uniforms[:, :w], exponentials=draws.exponentials))
              for w in range(1, tokens.shape[1] + 1)]
    return verify(target, tokens, draft, draws, num_valid=num_valid), chains, race_sample(target[:, 0], draws.exponentials)


@pytest.mark.parametrize("rule", ["standard", "block", "greedy", "synthetic"])
@pytest.mark.parametrize("one_hot", [False, True], ids=["probabilistic", "one-hot"])
def test_a_verifier_cut_to_w_drafts_is_the_verifier_of_the_first_w_drafts(rule, one_hot):
    """Row b cut to w_b drafts (num_valid) accepts and emits exactly what the rule gives the chain of its first
    w_b drafts with the same draws, the bonus included: with a causal target the scores at positions 0..w do
    not depend on later drafts, so a width fixed before the target's scores leaves each rule lossless (Sun et
    al.'s proof for block verification takes any fixed block length, w among them). w 0 emits a plain sample
    of the target at position 0."""
    target, tokens, draft, draws = random_block()
    num_valid = np.random.default_rng(0).integers(0, 5, 64).astype(np.int32)
    (n, next_token), chains, first = cut_and_chains(rule, target, tokens, None if one_hot else draft, draws, num_valid)
    for w in range(5):
        rows = np.flatnonzero(num_valid == w)
        if w == 0:
            expected_n = np.zeros(len(rows))
            expected_next = np.argmax(np.asarray(target)[rows, 0], -1) if rule == "greedy" else np.asarray(first)[rows]
        else:
            expected_n, expected_next = (np.asarray(x)[rows] for x in chains[w - 1])
        np.testing.assert_array_equal(np.asarray(n)[rows], expected_n, err_msg=f"{rule} w={w}")
        np.testing.assert_array_equal(np.asarray(next_token)[rows], expected_next, err_msg=f"{rule} w={w}")
    assert (np.asarray(n) <= num_valid).all()


# ---------------------------------------------------------------------------------------- cost curves

def test_cost_curves_analytic_and_profiled_once_then_read_from_disk(tmp_path, monkeypatch):
    curve = adaptive.CostCurve.analytic((1, 64), (0, 1, 3))
    np.testing.assert_allclose(curve.costs(64, (0, 3)), [1 + 64 / 300 + 0.2, 1 + 256 / 300 + 0.2], rtol=1e-6)
    skipping = adaptive.CostCurve.analytic((1, 64), (0, 1, 3), skips_drafting=True)  # width 0 drafts nothing
    np.testing.assert_allclose(skipping.costs(64, (0, 3)), [1 + 64 / 300, 1 + 256 / 300 + 0.2], rtol=1e-6)
    assert adaptive.CostCurve.from_json(curve.to_json()) == curve
    with pytest.raises(ValueError, match="CostCurve.seconds"):
        adaptive.CostCurve(batches=(1,), widths=(0, 1), seconds=((1.0,),))
    model = tiny_pair()[0]
    calls = []
    monkeypatch.setattr(adaptive, "profile", lambda *args: calls.append(args) or curve)
    timing = adaptive.StepTiming(key="a drafter", seconds=lambda batch, costs: [1.0] * len(costs))
    first = adaptive.cached_profile(model, 4, (0, 1, 3), 32, timing, directory=tmp_path)
    assert adaptive.cached_profile(model, 4, (0, 1, 3), 32, timing, directory=tmp_path) == first == curve
    assert len(calls) == 1 and len(list(tmp_path.glob("*.json"))) == 1
    adaptive.cached_profile(model, 8, (0, 1, 3), 32, timing, directory=tmp_path)  # another batch: profiled again
    other = dataclasses.replace(timing, key="another drafter")
    adaptive.cached_profile(model, 4, (0, 1, 3), 32, other, directory=tmp_path)  # another drafter: again
    assert len(calls) == 3 and calls[-1][-1] is other
    monkeypatch.undo()
    profiled = adaptive.profile(4, (0, 1, 3), timing)  # the timing's seconds, one a width
    assert profiled.seconds == ((1.0, 1.0, 1.0),) and profiled.source.startswith("profiled on")


def test_a_profile_times_the_loops_own_step_at_the_width_each_cost_vector_forces():
    """The profile runs speculative_step with its width forced by the cost vector (adaptive.forced_costs): the
    forced width is the step's whatever the estimates say, and every width is timed through one compiled loop."""
    from specjax.decoding import speculative_init, speculative_step, step_timing
    from specjax.proposers import build_proposer
    from specjax.verify import lossless_verifiers
    from specjax.verify.sampling import SamplingParams
    from support.compiles import compiled_programs

    target, draft = tiny_pair()
    spec = SpecConfig(num_speculative_tokens=3, enable_adaptive_verification=True)
    widths = spec.verify_widths
    assert widths == (0, 1, 2, 3)
    active = jnp.ones(4, bool)
    for index in range(len(widths)):  # every draft certain, and none: the forced width either way
        for estimate in (1.0, 0.0):
            choice = adaptive.choose_width(jnp.full((4, 3), estimate), active, widths,
                                           jnp.asarray(adaptive.forced_costs(widths, index)))
            assert int(choice) == index, (index, estimate)
    proposer = build_proposer(spec, SamplingConfig(), 32, draft)
    params = proposer.bind(draft, target)
    sampling = jax.tree.map(jnp.asarray, SamplingParams.of([SamplingConfig()] * 2, 2))
    state = jax.jit(functools.partial(speculative_init, proposer=proposer, eos_token_ids=()))(
        target, params, jnp.asarray([[1, 5, 2, 3], [4, 1, 6, 2]]), jnp.asarray([4, 4]), jnp.asarray([16, 16]),
        jax.vmap(jax.random.key)(jnp.arange(2)), sampling)
    step = jax.jit(functools.partial(speculative_step, proposer=proposer, verifiers=lossless_verifiers(spec),
                                     eos_token_ids=()))
    for index, width in enumerate(widths):
        after = step(target, params, state, jnp.int32(0), verify_costs=jnp.asarray(adaptive.forced_costs(widths, index)))
        np.testing.assert_array_equal(after.counters.drafted, [width, width], err_msg=f"forced width {width}")

    timing = step_timing(target, params, proposer)
    assert timing.skips_drafting and timing.key != step_timing(target, params, build_proposer(
        dataclasses.replace(spec, num_speculative_tokens=2), SamplingConfig(), 32, draft)).key
    with compiled_programs() as names:
        seconds = timing.seconds(2, [adaptive.forced_costs(widths, i) for i in range(len(widths))])
    assert len(seconds) == len(widths) and all(np.isfinite(seconds))  # timed (not compared: a busy host is noisy)
    assert names.count("run") == 1, names  # one loop program for every width


def test_the_profiled_step_keeps_all_the_work_of_the_loops_step():
    """step_profile_loop sets the state's integer leaves back before each step. Set back by a constant (the control),
    what the step wrote to them is dead, and XLA drops the work: fewer scatters than a loop of the step itself (the
    token writes, the counters). Set back through a predicate it cannot fold, as the profile does, every scatter
    and select of the step's own loop is in the compiled program."""
    from specjax.benchmarking import loop_program
    from specjax.decoding import speculative_step, step_profile_loop
    from specjax.proposers import build_proposer
    from specjax.verify import lossless_verifiers

    target, draft = tiny_pair()
    spec = SpecConfig(num_speculative_tokens=3, enable_adaptive_verification=True)
    proposer = build_proposer(spec, SamplingConfig(), 32, draft)
    _, program, arguments = step_profile_loop(target, proposer.bind(draft, target), proposer, 2)
    model, params, method, costs, start, keep, state = arguments(adaptive.forced_costs(spec.verify_widths, 3))

    def step(model, params, method, costs, state):
        after = speculative_step(model, params, state, method, proposer=proposer, verifiers=lossless_verifiers(spec),
                                 eos_token_ids=(), verify_costs=costs)
        return after.decode.lengths, (after,)

    def set_back(model, params, method, costs, start, state):
        leaves, treedef = jax.tree.flatten(state)
        given = iter(start)
        return step(model, params, method, costs, treedef.unflatten(
            [leaf if jnp.issubdtype(leaf.dtype, jnp.floating) else next(given) for leaf in leaves]))

    def ops(program, *args):
        text = program.lower(jnp.int32(2), *args).compile().as_text()
        return collections.Counter(re.findall(r"=\s*\S+\s+([\w-]+)\(", text))

    own = ops(loop_program(step, invariant=4, carry=True), model, params, method, costs, state)
    control = ops(loop_program(set_back, invariant=5, carry=True), model, params, method, costs, start, state)
    profiled = ops(program, model, params, method, costs, start, keep, state)
    assert control["scatter"] < own["scatter"], (control, own)
    assert profiled["scatter"] >= own["scatter"] and profiled["select"] >= own["select"], (profiled, own)


# ------------------------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("options, message", [
    (dict(enable_adaptive_verification=True, speculative_token_tree=((0,), (1,), (0, 0))),
     r"enable_adaptive_verification = True with speculative_token_tree .* cuts chains"),
    (dict(enable_adaptive_verification=True, total_tokens=4, tree_top_k=2),
     r"enable_adaptive_verification = True with total_tokens = 4 .* cuts chains"),
    (dict(adaptive_verify_widths=(0, 2)), r"adaptive_verify_widths = \(0, 2\) is invalid: allowed null without"),
    (dict(enable_adaptive_verification=True, adaptive_verify_widths=(0, 1)), r"ending with it \(2\)"),
    (dict(enable_adaptive_verification=True, adaptive_verify_widths=(1, 0, 2)), r"increasing integers"),
    (dict(enable_adaptive_verification=True, adaptive_verify_widths=(-1, 2)), r"in 0..num_speculative_tokens"),
    (dict(enable_adaptive_verification="yes"), r"enable_adaptive_verification = 'yes' is invalid: allowed true"),
])
def test_bad_settings_are_refused_naming_the_field(options, message):
    with pytest.raises(ConfigError, match=message):
        SpecConfig(num_speculative_tokens=2, **options)


def test_the_default_widths():
    widths = {k: SpecConfig(num_speculative_tokens=k, enable_adaptive_verification=True).verify_widths
              for k in (1, 3, 4, 5, 7, 8, 15, 16)}
    assert widths == {1: (0, 1), 3: (0, 1, 2, 3), 4: (0, 1, 2, 3, 4), 5: (0, 1, 2, 3, 4, 5), 7: (0, 1, 2, 3, 4, 5, 7),
                      8: (0, 1, 2, 3, 4, 6, 8), 15: (0, 1, 2, 3, 4, 5, 7, 10, 15), 16: (0, 1, 2, 3, 4, 6, 8, 11, 16)}
    assert SpecConfig(num_speculative_tokens=4).verify_widths == (4,)
    assert SpecConfig(num_speculative_tokens=4, enable_adaptive_verification=True,
                      adaptive_verify_widths=[1, 4]).verify_widths == (1, 4)


# ------------------------------------------------------------------------------ greedy = autoregressive

@functools.cache  # built once for generate and the engine
def drafter_for(method: str):
    target, drafts = target_and_drafts()
    if method == "draft_model":
        return drafts["perturbed"]
    if method == "dflash":
        return trained_dflash()
    if method == "eagle":
        return head_for("eagle")
    if method == "mtp":  # two modules: K 3 runs both, then the last again
        return mtp_modules(target.config, 2)
    from support.models import dspark_drafter  # random heads: drafts accepted now and then

    return dspark_drafter(target.config, block_size=8, rank=8)


# Widths of a step's forward cost the more the wider (a large batch's curve, made up): the chosen width follows
# each row's estimates and changes from step to step.
STEEP = adaptive.CostCurve(batches=(1,), widths=(0, 4), seconds=((1.0, 2.2),))
STEEPER = adaptive.CostCurve(batches=(1,), widths=(0, 4), seconds=((1.0, 4.0),))  # for 4 slots of the engine
METHODS = {"draft_model": 4, "dflash": 4, "dspark": 4}


@pytest.mark.loop
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_output_is_identical_to_autoregressive(method):
    """56 ragged prompts, budgets 1-24, EOS inside blocks; the width chosen per step changes (asserted), and DFlash's
    and DSpark's steps of width 0 draft nothing (Proposer.skips_drafting)."""
    target, _ = target_and_drafts()
    prompts, budgets = ragged_requests()
    spec = SpecConfig(method=method, num_speculative_tokens=METHODS[method], enable_adaptive_verification=True)
    result = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS], spec=spec,
                      drafter=drafter_for(method), cost_curve=STEEP)
    expected = autoregressive_outputs()
    assert result.sequences() == expected.sequences()
    assert (result.stopped_by_eos == expected.stopped_by_eos).all() and expected.stopped_by_eos.any()
    metrics = result.metrics
    widths = {w for row in range(len(prompts)) for w in metrics.per_step(row)["per_step_drafted"]}
    assert len(widths) > 1 and widths <= set(spec.verify_widths), widths
    assert metrics.drafted.sum() == metrics.per_step_drafted.sum()  # drafted counts what was verified
    assert (metrics.accepted <= metrics.drafted).all()


@pytest.mark.loop
@pytest.mark.parametrize("method", list(METHODS))
def test_the_engine_serves_each_request_its_autoregressive_output(method):
    """32 requests arriving at random steps, 4 slots; per-request detailed metrics carry the chosen widths. The
    draft model's requests are served again with the draft KV cache offloaded between visits (both features at
    once, tests/test_offload.py's property): the same tokens, finish reasons and acceptance counts. DFlash's
    and DSpark's prompts are prefilled in the steps (mixed prefill: the chunks ride in each width's verify forward
    and build the drafter's state through `extend`, DSpark's its confidences too)."""
    from support.engine import (autoregressive_under_load, load_config, random_requests, serve_arriving,
                                truncated_at_stop)

    from specjax.engine import Engine

    target, _ = target_and_drafts()
    requests = random_requests(32)
    spec = SpecConfig(method=method, num_speculative_tokens=3, enable_adaptive_verification=True)
    # A fixed visit_ends: paced visits (None) stop by measured times, so two engines would batch the requests
    # differently, and adaptive widths depend on which rows a step holds.
    config = load_config(spec, cost_curve=STEEPER, visit_ends=1,
                         **({"mixed_prefill_tokens": 4} if method in ("dflash", "dspark") else {}))
    engine = Engine(target, config, drafter=drafter_for(method))
    outputs = serve_arriving(engine, requests)
    # stats give the curve of each count of slots stepped (bench-serve predicts its step from it)
    curves = engine.stats()["adaptive_costs"]
    assert curves and set(curves) <= {1, 2, 4}, curves
    assert all(c == {"widths": list(spec.verify_widths), "source": "analytic",
                     "seconds": list(map(float, STEEPER.costs(rows, spec.verify_widths)))} for rows, c in curves.items())
    widths = set()
    for request, want in zip(requests, autoregressive_under_load()):
        got = outputs[request.request_id]
        assert list(got.tokens) == truncated_at_stop(want, request.stop_token_ids), request.request_id
        assert sum(got.metrics["per_step_drafted"]) == got.metrics["drafted"]
        widths |= set(got.metrics["per_step_drafted"])
    assert len(widths) > 1 and widths <= set(spec.verify_widths), widths
    if method == "draft_model":
        offloaded = Engine(target, dataclasses.replace(config, draft_kv_offload=True), drafter=drafter_for(method))
        for request_id, got in serve_arriving(offloaded, requests).items():
            want = outputs[request_id]
            assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason), request_id
            assert repr(got.metrics) == repr(want.metrics), request_id  # repr: a row without steps has NaN rates
        assert offloaded.stats()["draft_kv_offload"]["bytes_to_device"] > 0


def skip_twice_then_draft(method: str, proposer_kind: str):
    """The state after two steps at width 0, then one at K (the widths' costs are data: 0, then K, is the cheapest),
    for a drafter whose proposer skips drafting at width 0 ('skips'), drafts there and verifies nothing ('drafts'),
    or skips with an idle that leaves the state as it is ('forgets': the negative control)."""
    target, _ = target_and_drafts()
    spec = SpecConfig(method=method, num_speculative_tokens=3, enable_adaptive_verification=True,
                      adaptive_verify_widths=(0, 3))
    args, static = speculative_loop_args(target, drafter_for(method), [[5, 9, 2, 7], [3] * 11], 8, spec,
                                         SamplingConfig())
    skipping = static["proposer"]
    assert skipping.skips_drafting
    fields = {field.name: getattr(skipping, field.name) for field in dataclasses.fields(skipping)}
    forgets = {"idle": lambda self, params, state, context: state,
               "accept_verified": Proposer.accept_verified}  # DFlash's pending window then reaches no cache
    proposer = {"skips": skipping, "drafts": type("Drafts", (type(skipping),), {"skips_drafting": False})(**fields),
                "forgets": type("Forgets", (type(skipping),), forgets)(**fields)}[proposer_kind]
    *loop_args, method_arg = args
    init = functools.partial(decoding.speculative_init, proposer=proposer, eos_token_ids=static["eos_token_ids"])
    state = jax.jit(init)(*loop_args)
    step = jax.jit(functools.partial(decoding.speculative_step, **dict(static, proposer=proposer)))
    for costs in ([1.0, 100.0], [1.0, 100.0], [100.0, 1.0]):
        state = step(*args[:2], state, method_arg, verify_costs=jnp.array(costs))
    assert (state.counters.per_step_drafted[:, :3] == jnp.array([0, 0, 3])).all()  # the widths asked for
    return state


def host_leaves(state) -> list:
    """(path, host array) of every leaf, keys as their data."""
    def host(x):
        return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)

    return [(jax.tree_util.keystr(path), host(x)) for path, x in jax.tree_util.tree_leaves_with_path(state)]


@pytest.mark.loop
@pytest.mark.parametrize("whole", [False, True])
def test_held_visits_verify_the_width_chosen_last_and_hand_back_to_the_switch_when_the_choice_moves(whole):
    """EngineConfig.adaptive_held_visits on one slot, under a curve whose choice moves among the widths as the
    estimates follow a perturbed draft model: after a visit whose last step chose width w (one worth choosing at
    the count), the next runs the program held at w (every step w), which ends at the first step whose choice would
    be another, and after it (or at a width not worth choosing) the switch's program runs. With
    adaptive_held_whole_visits a held visit runs all its steps at w, its choice moving or not (and some do move).
    Each step's choice is replayed on the host from the request's per-step verified and accepted counts
    (AdaptiveState's estimate, choose_width). Output: the autoregressive one. The warm-up compiles every program the
    visits run (the switch's and each held one): serving compiles none."""
    from support.compiles import compiled_programs
    from support.engine import load_config

    from specjax.engine import Engine, Request

    target, _ = target_and_drafts()
    curve = adaptive.CostCurve(batches=(1,), widths=(0, 3), seconds=((1.0, 1.6),))
    spec = SpecConfig(method="draft_model", num_speculative_tokens=3, enable_adaptive_verification=True)
    engine = Engine(target, load_config(spec, cost_curve=curve, max_num_seqs=1, steps_per_visit=4,
                                        adaptive_held_whole_visits=whole), drafter=drafter_for("draft_model"))
    engine.warmup(8)
    prompt = [5, 1, 7, 2]
    engine.add_request(Request.make("a", prompt, 56))
    visits, outputs = [], []  # (steps, held) of each visit
    with compiled_programs() as compiled:
        while engine.has_work():
            steps, held = engine.steps_run, engine.held_steps
            outputs += engine.step()
            ran = engine.steps_run - steps
            assert engine.held_steps - held in (0, ran)  # a visit is held or not, all its steps
            visits.append((ran, engine.held_steps - held == ran > 0))
    assert compiled == []
    assert list(outputs[0].tokens) == generate(target, [prompt], max_new_tokens=56, eos_token_ids=(EOS,)).sequences()[0]
    metrics = outputs[0].metrics
    widths, accepted, active = metrics["per_step_drafted"], metrics["per_step_accepted"], np.ones(1, bool)
    state, chosen, costs = adaptive.AdaptiveState.init(1, 3), [], adaptive.verify_costs(spec, curve, 1)
    holdable = {w for w, cost in zip(spec.verify_widths, np.asarray(costs)) if cost < adaptive.FORCED_OUT}
    for verified, took in zip(widths, accepted):  # what each step chose, replayed
        choice = adaptive.choose_width(state.estimate(active), active, spec.verify_widths, costs)
        chosen.append(spec.verify_widths[int(choice)])
        state = state.observe(active, np.asarray([verified]), np.asarray([took]))
    at, held_at, moved = 0, set(), False
    for index, (steps, held) in enumerate(visits):
        mine, would, at = widths[at:at + steps], chosen[at:at + steps], at + steps
        if held:  # the last visit's last choice every step; ended where the choice moved (whole: never), or after 4
            hold = chosen[at - steps - 1]
            held_at.add(hold)
            moved |= any(w != hold for w in would[:-1])
            assert set(mine) == {hold} and (whole or not moved), (visits, widths, chosen)
            assert (would[-1] != hold and not whole) or steps == 4 or at == len(widths), (visits, widths, chosen)
        else:
            assert mine == would, (visits, widths, chosen)
        if index + 1 < len(visits):
            assert visits[index + 1][1] == (would[-1] in holdable), (visits, widths, chosen)
    assert {held for _, held in visits} == {True, False} and len(held_at) > 1, (visits, widths, chosen)
    assert moved == whole, (visits, widths, chosen)  # whole visits ran on past a moved choice


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "eagle", "dflash", "mtp"])  # DSpark's idle is DFlash's
def test_steps_that_skip_drafting_leave_the_drafter_as_steps_that_drafted_and_verified_none(method):
    """Proposer.idle does what propose does to the state besides drafting: after two steps that skipped, the next
    step drafts, verifies and leaves everything (tokens, counts, the drafter's cache) exactly as after two steps that
    drafted for nothing; an idle that leaves the state as it is (the skipped positions never reach the drafter's
    cache; for DFlash, which writes them in accept_verified, with the default accept_verified) is caught."""
    skipped, drafted = (host_leaves(skip_twice_then_draft(method, kind)) for kind in ("skips", "drafts"))
    for (path, a), (_, b) in zip(skipped, drafted):
        np.testing.assert_array_equal(a, b, err_msg=path)
    forgot = host_leaves(skip_twice_then_draft(method, "forgets"))
    assert [path for (path, a), (_, b) in zip(forgot, drafted) if not np.array_equal(a, b)]


def steps_at_k(method: str, adaptive_k: bool, forget: bool = False) -> tuple:
    """Four steps at K 3 (an adaptive loop's only width, or fixed K): the committed tokens, the accepted counts
    and the drafter's cache. forget: the proposer's accept_verified is the default (the negative control)."""
    target, _ = target_and_drafts()
    spec = SpecConfig(method=method, num_speculative_tokens=3, enable_adaptive_verification=adaptive_k,
                      adaptive_verify_widths=(3,) if adaptive_k else None)
    prompts, _ = ragged_requests()
    args, static = speculative_loop_args(target, drafter_for(method), prompts[:4], 16, spec, SamplingConfig())
    proposer = static["proposer"]
    if forget:
        forgets = type("Forgets", (type(proposer),), {"accept_verified": Proposer.accept_verified})
        proposer = forgets(**{field.name: getattr(proposer, field.name) for field in dataclasses.fields(proposer)})
    *loop_args, method_arg = args
    state = jax.jit(functools.partial(decoding.speculative_init, proposer=proposer,
                                      eos_token_ids=static["eos_token_ids"]))(*loop_args)
    step = jax.jit(functools.partial(decoding.speculative_step, **dict(static, proposer=proposer)))
    for _ in range(4):
        state = step(*args[:2], state, method_arg)
    decode = state.decode  # the fixed loop's last features are pending: written as its next propose would
    settled = proposer.idle(args[1], state.proposer, Context(decode.tokens, decode.lengths, decode.sampling))
    return decode.tokens, state.counters.accepted, proposer.prefix_cache(settled)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "dflash", "dspark"])
def test_writing_the_committed_features_in_the_branch_drafts_as_the_next_proposes_window_does(method):
    """accept_verified takes the committed positions inside the switch's branch (at its width + 1: DFlash writes
    their context features, EAGLE runs its head over their pairs) where a fixed-K loop leaves them pending for the
    next propose's window of K + 1: four steps of an adaptive loop whose one width is K commit the same tokens,
    accept the same drafts and leave the same drafter cache as the fixed-K loop's. An accept_verified that writes
    nothing (the default's pending window, which an adaptive loop's propose does not take) is caught."""
    fixed, branch = steps_at_k(method, False), steps_at_k(method, True)
    assert fixed[1].sum() > 0  # the trained drafter's drafts are accepted: the features matter
    np.testing.assert_array_equal(fixed[0], branch[0])
    np.testing.assert_array_equal(fixed[1], branch[1])
    for a, b in zip(jax.tree.leaves(fixed[2]), jax.tree.leaves(branch[2])):  # the projections fused apart: rounding
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    forgot = steps_at_k(method, True, forget=True)
    assert not all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
                   for a, b in zip(jax.tree.leaves(fixed), jax.tree.leaves(forgot)))


@pytest.mark.loop
def test_adaptive_generation_is_one_program_with_its_widths_inside_one_outer_loop():
    """The widths are branches of a switch inside the one loop, not loops or programs of their own. Without widest
    runs (the default) the loop's body is the switch's step alone; with them, the switch's step and then one loop of
    steps with no switch."""
    target, _ = target_and_drafts()
    spec = SpecConfig(method="dflash", num_speculative_tokens=3, rejection_sample_method="block",
                      draft_sample_method="probabilistic", enable_adaptive_verification=True)
    drafter = init_dflash(dflash_config(target.config, (0, 1), 8))
    args, static = speculative_loop_args(target, drafter, [[1, 2, 3], [4] * 9], 10, spec, T1, eos_token_ids=(2,))
    costs = adaptive.verify_costs(spec, STEEP, 2)
    num_widths = len(spec.verify_widths)

    def switches(jaxpr):  # the width switches among a jaxpr's equations, nested ones included
        return [eqn for eqn, _ in equations(jaxpr) if eqn.primitive.name == "cond"
                and len(eqn.params["branches"]) == num_widths]

    for widest_runs in (True, False):
        jaxpr = jax.make_jaxpr(functools.partial(speculative_loop, **static, widest_runs=widest_runs))(*args, costs)
        prims = primitives(jaxpr.jaxpr)
        assert [name for name, depth in prims if depth == 0] in (["pjit"], ["jit"])
        assert not [name for name, _ in prims if "callback" in name or "feed" in name]
        loops = [eqn for eqn, _ in equations(jaxpr.jaxpr) if eqn.primitive.name == "while"]
        body = loops[0].params["body_jaxpr"].jaxpr
        assert len(switches(body)) == 1  # the switch's step, inside the (outer) loop
        if widest_runs:
            assert len(loops) == 2 and loops[1] in [eqn for eqn, _ in equations(body)]  # nested in the body
            inner = loops[1].params["body_jaxpr"].jaxpr
            assert not switches(inner) and [e for e, _ in equations(inner) if e.primitive.name == "dot_general"]
        else:
            assert len(loops) == 1


@pytest.mark.loop
def test_widest_runs_verify_every_draft_until_a_step_would_narrow():
    """speculative_loop's widest_runs on one row, under a curve whose choice moves between K and narrower widths as
    the estimates follow a perturbed draft model: a step after one whose choice was K verifies K (and chooses, only to
    end the run), any other verifies what it chose. Each step's choice is replayed on the host from the row's
    per-step verified and accepted counts (AdaptiveState's estimate, choose_width). Without widest runs every step
    verifies its choice, which the same replay tells apart; both outputs are the autoregressive one."""
    target, _ = target_and_drafts()
    curve = adaptive.CostCurve(batches=(1,), widths=(0, 3), seconds=((1.0, 1.6),))
    spec = SpecConfig(method="draft_model", num_speculative_tokens=3, enable_adaptive_verification=True)
    prompt, costs = [5, 1, 7, 2], adaptive.verify_costs(spec, curve, 1)
    args, static = speculative_loop_args(target, drafter_for("draft_model"), [prompt], 48, spec, SamplingConfig(),
                                         eos_token_ids=(EOS,))
    expected = generate(target, [prompt], max_new_tokens=48, eos_token_ids=(EOS,)).sequences()[0]

    def verified_and_chosen(widest_runs: bool) -> tuple[list, list]:
        state = speculative_loop(*args, costs, **static, widest_runs=widest_runs)
        length = int(state.decode.lengths[0])
        assert list(np.asarray(state.decode.tokens[0, len(prompt):length])) == expected
        steps = int(state.counters.steps[0])
        widths = [int(w) for w in state.counters.per_step_drafted[0, :steps]]
        accepted = [int(a) for a in state.counters.per_step_accepted[0, :steps]]
        replay, chosen, active = adaptive.AdaptiveState.init(1, 3), [], np.ones(1, bool)
        for verified, took in zip(widths, accepted):
            choice = adaptive.choose_width(replay.estimate(active), active, spec.verify_widths, costs)
            chosen.append(spec.verify_widths[int(choice)])
            replay = replay.observe(active, np.asarray([verified]), np.asarray([took]))
        return widths, chosen

    widths, chosen = verified_and_chosen(True)
    runs = [index > 0 and chosen[index - 1] == 3 for index in range(len(widths))]  # the steps of widest runs
    assert [3 if widest else would for widest, would in zip(runs, chosen)] == widths, (widths, chosen)
    assert any(widest and would < 3 for widest, would in zip(runs, chosen)), (widths, chosen)  # a run ended
    assert any(runs) and not all(runs[1:]) and len(set(widths)) > 1, (widths, chosen)
    widths, chosen = verified_and_chosen(False)
    assert widths == chosen
    assert any(index > 0 and chosen[index - 1] == 3 and would < 3 for index, would in enumerate(chosen)), chosen


# ------------------------------------------------------------------------------------ exact distribution

LOSSLESS_ALPHA = 1e-4  # test_lossless.py's threshold
GREEDY_ROWS = 64
SAMPLINGS = (T1, SamplingConfig(temperature=0.7, top_k=5))
# K 3 on the tiny target: the first step verifies 2 of the 3 drafts (1.4 against 4.0 for all three), so the
# cut and its bonus token are tested; once the estimates have dropped, steps verify none (width 0: the
# target's own sample), measured for the draft model.
CUT = adaptive.CostCurve(batches=(1,), widths=(0, 1, 2, 3), seconds=((1.0, 1.2, 1.4, 4.0),))


def tiny_spec(method: str, verifier: str) -> SpecConfig:
    drafting = "greedy" if method == "dspark" else "probabilistic"  # DSpark's head is read for greedy drafts
    return SpecConfig(method=method, num_speculative_tokens=3, rejection_sample_method=verifier,
                      draft_sample_method=drafting, enable_adaptive_verification=True)


@functools.cache  # built once for both verifiers
def tiny_drafter(method: str):
    if method == "draft_model":
        return tiny_pair()[1]
    if method == "dflash":  # the tiny target has one layer: its output (the final hidden state)
        return init_dflash(dflash_config(TINY, (0,), block_size=4), seed=5)
    from test_dspark import tiny_dspark

    return tiny_dspark()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "dflash", "dspark"])
def test_speculative_sampling_is_lossless(method):
    """Standard and block verification, T 1 and T 0.7 top-k 5 rows beside greedy rows, widths below K chosen and
    steps that skip drafting (asserted): a draft model's and DFlash's probabilistic drafts (the counts decide) and
    DSpark's greedy drafts (its confidence head decides once it has drafted)."""
    target = tiny_pair()[0]
    expected_greedy = generate(target, [[1, 5, 2]], max_new_tokens=3).tokens[0]
    for verifier in ("standard", "block"):
        counts, metrics, greedy_tokens = joint_counts_by_sampling(tiny_spec(method, verifier), SAMPLINGS,
                                                                  tiny_drafter(method), greedy_rows=GREEDY_ROWS,
                                                                  cost_curve=CUT)
        assert 0 < metrics.summary()["acceptance_rate"] < 1
        assert set(np.unique(metrics.per_step_drafted)) - {0, 3}, "no step cut the block"
        within = np.arange(metrics.per_step_drafted.shape[1])[None, :] < metrics.steps[:, None]  # the rows' steps
        assert (metrics.per_step_drafted[within] == 0).any(), "no step skipped drafting"
        assert (greedy_tokens == expected_greedy).all(), verifier
        for sampling, sampling_counts in zip(SAMPLINGS, counts):
            p_value = chi_square_pvalue(sampling_counts, exact_joint(target, sampling))
            assert p_value > LOSSLESS_ALPHA, (method, verifier, sampling, p_value)


@pytest.mark.loop
@pytest.mark.slow
def test_sampled_requests_in_the_engine_follow_the_target_distribution():
    """The engine (rows admitted among others start from their batch mates' estimates): DFlash's probabilistic
    drafts, T 1 and T 0.7 top-k 5 requests beside greedy ones, 2,048 slots, widths cut and steps that skip drafting
    (asserted); test_engine.py's chi-square with adaptive verification on."""
    from test_engine import ENGINE_SAMPLINGS, engine_joint_counts

    target = tiny_pair()[0]
    parts, greedy, outputs, _ = engine_joint_counts(tiny_spec("dflash", "standard"), tiny_drafter("dflash"),
                                                    cost_curve=CUT)
    assert (greedy == generate(target, [PROMPT], max_new_tokens=NUM_TOKENS).tokens[0]).all()
    widths = {w for output in outputs.values() for w in output.metrics["per_step_drafted"]}
    assert 0 in widths and widths - {0, 3}, widths  # steps that skipped drafting, and blocks cut
    for sampling, codes in zip(ENGINE_SAMPLINGS, parts):
        counts = np.bincount(codes, minlength=TINY.vocab_size ** NUM_TOKENS)
        p_value = chi_square_pvalue(counts, exact_joint(target, sampling))
        assert p_value > LOSSLESS_ALPHA, (sampling, p_value)


def test_the_server_serves_with_held_visits_unless_its_config_turns_them_off():
    """ServeConfig.adaptive_held_visits and adaptive_held_whole_visits reach the engine's settings (with the other
    engine fields it sets), from YAML's `--set` too; a value that is not a boolean is refused, naming the field.
    Held visits run whole by default."""
    from specjax.serve import ServeConfig, load_serve_config

    default = ServeConfig().engine_config(())
    assert (default.adaptive_held_visits, default.adaptive_held_whole_visits) == (True, True)
    assert ServeConfig(adaptive_held_whole_visits=False).engine_config(()).adaptive_held_whole_visits is False
    config = load_serve_config(None, None, ["adaptive_held_visits=false", "max_num_seqs=4", "async_scheduling=true",
                                            "steps_per_visit=3", "step_slot_counts=[1,4]"])
    engine = config.engine_config((7,))
    assert (engine.adaptive_held_visits, engine.max_num_seqs, engine.async_scheduling, engine.steps_per_visit,
            tuple(engine.step_slot_counts), engine.eos_token_ids) == (False, 4, True, 3, (1, 4), (7,))
    with pytest.raises(ConfigError, match=r"ServeConfig.adaptive_held_visits = 'no' is invalid"):
        ServeConfig(adaptive_held_visits="no")
    with pytest.raises(ConfigError, match=r"ServeConfig.adaptive_held_whole_visits = 'yes' is invalid: allowed true or "
                                          r"false"):
        ServeConfig(adaptive_held_whole_visits="yes")


@pytest.mark.loop
@pytest.mark.slow
def test_sampled_requests_in_held_visits_follow_the_target_distribution():
    """Held visits under sampling: every width costs the same (K chosen at every step) and a visit runs one step,
    so every step after the first runs the program held at K (asserted from the engine's stats); DFlash's probabilistic
    drafts, T 1 and T 0.7 top-k 5 requests beside greedy ones, test_engine.py's chi-square."""
    from test_engine import ENGINE_SAMPLINGS, engine_joint_counts

    target = tiny_pair()[0]
    flat = adaptive.CostCurve(batches=(1,), widths=(0, 3), seconds=((1.0, 1.0),))
    parts, greedy, outputs, stats = engine_joint_counts(tiny_spec("dflash", "standard"), tiny_drafter("dflash"),
                                                        cost_curve=flat, steps_per_visit=1)
    assert (greedy == generate(target, [PROMPT], max_new_tokens=NUM_TOKENS).tokens[0]).all()
    assert {w for output in outputs.values() for w in output.metrics["per_step_drafted"]} == {3}
    assert stats["steps"] > 1 and stats["held_steps"] == stats["steps"] - 1, stats
    for sampling, codes in zip(ENGINE_SAMPLINGS, parts):
        counts = np.bincount(codes, minlength=TINY.vocab_size ** NUM_TOKENS)
        p_value = chi_square_pvalue(counts, exact_joint(target, sampling))
        assert p_value > LOSSLESS_ALPHA, (sampling, p_value)


@pytest.mark.slow
def test_negative_control_a_width_chosen_from_the_rows_own_sampled_draft_fails(monkeypatch):
    """The same check catches what the estimator must not do: read the row's own sampled draft, here verifying
    none of it where its first draft is not the drafter's most likely token (an 'unsure' draft). The width then
    depends on the draft: the drafter's mode m is emitted with probability min(p(m), q(m)) + (1 - q(m)) p(m),
    above the target's p(m)."""
    import specjax.decoding as decoding

    verify_drafts = decoding.verify_drafts

    def peeking(logits, draft_tokens, draft_probs, keys, parents, *, num_valid, **options):
        unsure = draft_tokens[:, 0] != jnp.argmax(draft_probs[:, 0], axis=-1)
        return verify_drafts(logits, draft_tokens, draft_probs, keys, parents,
                             num_valid=jnp.where(unsure, 0, num_valid), **options)

    # The patched function is traced into the loop: no program compiled before may serve it, and none compiled
    # with it may serve a later test of the same shapes.
    speculative_loop.clear_cache()
    monkeypatch.setattr(decoding, "verify_drafts", peeking)
    try:
        counts, metrics, _ = joint_counts_by_sampling(tiny_spec("draft_model", "standard"), [T1],
                                                      tiny_drafter("draft_model"), cost_curve=CUT)
    finally:
        speculative_loop.clear_cache()
    assert 0 < metrics.summary()["acceptance_rate"] < 1
    assert chi_square_pvalue(counts[0], exact_joint(tiny_pair()[0], T1)) < 1e-6  # measured: 2e-22 (8,192 rows)

"""Speculative decoding in the loop: synthetic acceptance, metric identities, one compiled program,
and refusals. Greedy equality and the exact output distribution of every drafter: tests/test_lossless.py."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from support.distributions import PROMPT, TINY, tiny_pair
from support.jaxpr import equations, primitives, speculative_loop_args
from support.models import EOS, dflash_config, medusa_for, target_and_drafts
from support.requests import ragged_requests

from specjax.config import ConfigError, SamplingConfig, SpecConfig
from specjax.decoding import generate, speculative_loop
from specjax.models.dflash import init_dflash
from specjax.models.transformer import init_model


# ------------------------------------------------------------------------------------------- synthetic

@pytest.mark.loop
@pytest.mark.slow
@pytest.mark.parametrize("length", [2.0, 3.3, 4.5])
def test_synthetic_mean_acceptance_length_is_the_one_asked_for(length):
    target, draft = tiny_pair()
    spec = SpecConfig(num_speculative_tokens=5, rejection_sample_method="synthetic",
                      synthetic_acceptance_length=length)
    result = generate(target, [PROMPT] * 256, max_new_tokens=120, spec=spec, drafter=draft,
                      sampling=SamplingConfig(temperature=1.0), seeds=np.arange(256))
    summary = result.metrics.summary()
    assert summary["steps"] > 5000
    assert summary["mean_acceptance_length"] == pytest.approx(length, rel=0.02)


def test_synthetic_rates_from_a_length_follow_vllm():
    spec = SpecConfig(num_speculative_tokens=5, rejection_sample_method="synthetic", synthetic_acceptance_length=3.3)
    assert spec.synthetic_rates == pytest.approx((1.0, 1.0, 0.3, 0.0, 0.0))


# --------------------------------------------------------------------------------------------- metrics

@pytest.mark.loop
def test_metric_identities():
    target, drafts = target_and_drafts()
    prompts, budgets = ragged_requests()
    num_draft = 4
    result = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS],
                      spec=SpecConfig(num_speculative_tokens=num_draft), drafter=drafts["perturbed"])
    m = result.metrics
    np.testing.assert_array_equal(m.length_histogram.sum(1), m.steps)
    np.testing.assert_array_equal(m.length_histogram @ np.arange(num_draft + 1), m.accepted)
    np.testing.assert_array_equal(m.accepted_at.sum(1), m.accepted)
    np.testing.assert_array_equal(m.drafted, num_draft * m.steps)
    # Every token but the prefill's came from a step; each step emits accepted + 1 except the last,
    # which is cut at the budget or the EOS (by at most K tokens).
    np.testing.assert_array_equal(result.num_generated, 1 + m.emitted)
    full = m.accepted + m.steps
    assert ((m.emitted <= full) & (m.emitted >= full - num_draft)).all()
    uncut = ~result.stopped_by_eos & (result.num_generated < np.array(budgets))
    assert not uncut.any()  # every row ended by EOS or budget
    summary = m.summary()
    assert summary["mean_acceptance_length"] == pytest.approx(1 + m.accepted.sum() / m.steps.sum())
    assert summary["per_position_acceptance"] == sorted(summary["per_position_acceptance"], reverse=True)
    assert len(m.per_request()) == len(prompts)


def test_per_request_has_summarys_fields_as_plain_numbers_and_vllms_names():
    """Two rows at K 3: row 0 took two steps accepting 3 then 2 drafts, of which its budget kept 3 + 1 then 1
    (the 2 accepted past its budget are counted, as vLLM's scheduler counts them; emitted says what was
    kept); row 1 one step accepting none."""
    from specjax.metrics import AcceptanceMetrics

    m = AcceptanceMetrics(steps=np.array([2, 1]), drafted=np.array([6, 3]), accepted=np.array([5, 0]),
                          emitted=np.array([5, 1]), length_histogram=np.array([[0, 0, 1, 1], [1, 0, 0, 0]]),
                          accepted_at=np.array([[2, 2, 1], [0, 0, 0]]))
    rows, total = m.per_request(), m.summary()
    assert all(row.keys() == total.keys() for row in rows)
    for stats in (*rows, total):
        for value in stats.values():
            assert type(value) in (int, float) or all(type(v) in (int, float) for v in value), value
    assert repr(rows[0]["acceptance_rate"]) == "0.8333333333333334"  # not np.float64(...)
    assert {k: rows[0][k] for k in (
        "mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram", "num_spec_steps",
        "num_accepted_draft_tokens", "num_draft_tokens", "num_spec_tokens", "num_emitted_tokens",
        "mean_emitted_length", "per_position_acceptance")} == {
        "mean_acceptance_length": 3.5, "draft_acceptance_rate": 5 / 6, "acceptance_histogram": [0, 0, 1, 1],
        "num_spec_steps": 2, "num_accepted_draft_tokens": 5, "num_draft_tokens": 6, "num_spec_tokens": 3,
        "num_emitted_tokens": 5, "mean_emitted_length": 2.5, "per_position_acceptance": [1.0, 1.0, 0.5]}
    assert total["accepted"] == total["num_accepted_draft_tokens"] == 5
    assert total["mean_acceptance_length"] == pytest.approx(1 + 5 / 3)
    assert "tokens kept a step: 2.000" in m.format_summary()


# ------------------------------------------------------------------------------------ one program

@pytest.mark.loop
@pytest.mark.parametrize("method", ["draft_model", "dflash", "medusa_tree"])
def test_speculative_generation_is_one_program_with_one_while_loop(method):
    target, drafts = target_and_drafts()
    sampling = SamplingConfig(temperature=0.8)
    spec = SpecConfig(method=method, num_speculative_tokens=3, rejection_sample_method="block",
                      draft_sample_method="probabilistic")
    if method == "draft_model":
        drafter = drafts["perturbed"]
    elif method == "dflash":
        drafter = init_dflash(dflash_config(target.config, (0, 1), 8))
    else:  # a static draft tree, verified by recursive rejection sampling
        drafter = medusa_for(target, num_heads=3, scale=0.05)
        spec = SpecConfig(method="medusa", num_speculative_tokens=3,
                          speculative_token_tree=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))
    args, static = speculative_loop_args(target, drafter, [[1, 2, 3], [4] * 9], 10, spec, sampling,
                                         eos_token_ids=(2,))
    prims = primitives(jax.make_jaxpr(functools.partial(speculative_loop, **static))(*args).jaxpr)
    assert [name for name, depth in prims if depth == 0] in (["pjit"], ["jit"])
    assert [name for name, depth in prims if name == "while" and depth == 1] == ["while"]
    assert not [name for name, _ in prims if "callback" in name or "feed" in name]
    hlo = speculative_loop.lower(*args, **static).as_text()
    assert "callback" not in hlo and "outfeed" not in hlo


# ------------------------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("kwargs, message", [
    (dict(rejection_sample_method="block", synthetic_acceptance_length=3.0),
     r"rejection_sample_method = 'block' cannot be combined with synthetic_acceptance_rates / "
     r"synthetic_acceptance_length: allowed only with rejection_sample_method 'synthetic'"),
    (dict(num_speculative_tokens=0), r"SpecConfig.num_speculative_tokens = 0 is invalid: allowed an integer >= 1"),
    (dict(draft_sample_method="beam"), r"draft_sample_method = 'beam' is invalid"),
    (dict(num_speculative_tokens=3, rejection_sample_method="synthetic", synthetic_acceptance_rates=(0.5, 0.7, 0.2)),
     r"synthetic_acceptance_rates = \(0.5, 0.7, 0.2\) is invalid: allowed non-increasing values"),
    (dict(num_speculative_tokens=2, rejection_sample_method="synthetic", synthetic_acceptance_rates=(0.5, 0.2),
          synthetic_acceptance_length=2.0), r"needs exactly one of synthetic_acceptance_rates"),
    (dict(num_speculative_tokens=2, rejection_sample_method="synthetic"), r"needs exactly one of"),
    (dict(num_speculative_tokens=2, rejection_sample_method="synthetic", synthetic_acceptance_length=3.5),
     r"synthetic_acceptance_length = 3.5 is invalid: allowed a mean acceptance length in \[1, "),
    (dict(num_speculative_tokens=2, rejection_sample_method="synthetic", synthetic_acceptance_rates=(0.5,)),
     r"allowed 2 values"),
])
def test_bad_spec_configs_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SpecConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(rejection_sample_method="typical"), r"rejection_sample_method = 'typical' is invalid: allowed one of"),
    (dict(method="lookahead"), r"SpecConfig.method = 'lookahead' is invalid: allowed one of \['dflash', 'draft_model'"),
])
def test_unregistered_names_are_refused_when_generating(kwargs, message):
    target, drafts = target_and_drafts()
    spec = SpecConfig(**kwargs)  # the registries check their names, not the config
    with pytest.raises(ConfigError, match=message):
        generate(target, [[1, 2]], max_new_tokens=4, spec=spec, drafter=drafts["perturbed"])


def test_draft_with_another_vocabulary_is_refused():
    target, _ = target_and_drafts()
    other = init_model(TINY, seed=0)
    with pytest.raises(ValueError, match=r"draft vocab_size 8 differs from the target's 128"):
        generate(target, [[1, 2]], max_new_tokens=4, spec=SpecConfig(), drafter=other)


def test_cache_too_short_for_the_lookahead_is_refused():
    target, drafts = target_and_drafts()
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\) \+ max_new_tokens \(40\) \+ drafts scored per step "
                                         r"\+ 1 \(5\) = 65 "
                                         r"does not fit cache_size 64"):
        generate(target, [[1] * 20], max_new_tokens=40, cache_size=64, spec=SpecConfig(num_speculative_tokens=4),
                 drafter=drafts["perturbed"])


def _exp_output_widths(sampling: SamplingConfig) -> set[int]:
    """Last-axis sizes of every exp the speculative loop computes (softmax needs exp)."""
    target, drafts = target_and_drafts()
    spec = SpecConfig(num_speculative_tokens=3, draft_sample_method="probabilistic")
    args, static = speculative_loop_args(target, drafts["perturbed"], [[1, 2, 3]], 10, spec, sampling)
    jaxpr = jax.make_jaxpr(functools.partial(speculative_loop, **static))(*args).jaxpr
    return {eqn.outvars[0].aval.shape[-1] for eqn, _ in equations(jaxpr) if eqn.primitive.name == "exp"}


@pytest.mark.loop
def test_at_temperature_zero_nothing_over_the_vocabulary_is_exponentiated():
    vocab = target_and_drafts()[0].config.vocab_size
    assert vocab not in _exp_output_widths(SamplingConfig(temperature=0.0))
    assert vocab in _exp_output_widths(SamplingConfig(temperature=1.0))  # the check can see it


MIXED = [SamplingConfig(), SamplingConfig(temperature=0.7, top_p=0.9), SamplingConfig(temperature=1.0, top_k=5)]


@pytest.mark.loop
def test_one_program_serves_greedy_and_sampled_rows_with_either_lossless_verifier():
    """Sampling settings and the lossless rule are data: greedy, T 0.7 top-p 0.9 and T 1 top-k 5 rows share
    one loop with standard and with block verification; each row is what it is alone."""
    target, drafts = target_and_drafts()
    prompts = [[3, 9, 27], [5, 1], [2, 2, 2]]
    spec = SpecConfig(num_speculative_tokens=3, draft_sample_method="probabilistic")
    kwargs = dict(max_new_tokens=9, drafter=drafts["perturbed"], seeds=[0, 1, 2])
    standard = generate(target, prompts, spec=spec, sampling=MIXED, **kwargs)
    compiled = speculative_loop._cache_size()
    block = generate(target, prompts, spec=dataclasses.replace(spec, rejection_sample_method="block"),
                     sampling=MIXED, **kwargs)
    assert speculative_loop._cache_size() == compiled  # the same program
    autoregressive = generate(target, prompts[:1], max_new_tokens=9).sequences()[0]
    assert standard.sequences()[0] == block.sequences()[0] == autoregressive
    for row in (1, 2):  # a row's tokens depend on its prompt, seed and settings, not on its batch mates
        alone = generate(target, [prompts[row]], spec=spec, sampling=MIXED[row], max_new_tokens=9,
                         drafter=drafts["perturbed"], seeds=[row])
        assert alone.sequences()[0] == standard.sequences()[row]


@pytest.mark.loop
def test_a_temperature_sweep_compiles_the_loop_once():
    target, drafts = target_and_drafts()
    spec = SpecConfig(num_speculative_tokens=3, draft_sample_method="probabilistic")
    outputs = []
    for point, temperature in enumerate((0.2, 0.4, 0.6, 0.8, 1.0)):
        outputs.append(generate(target, [[3, 9, 27]], spec=spec, sampling=SamplingConfig(temperature=temperature),
                                max_new_tokens=12, drafter=drafts["perturbed"]).sequences()[0])
        if point == 0:
            compiled = speculative_loop._cache_size()
    assert speculative_loop._cache_size() == compiled
    assert len({tuple(o) for o in outputs}) > 1  # the temperature reached the program
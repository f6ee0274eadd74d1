"""Speculative decoding in the loop: greedy output identical to autoregressive, exact output
distribution when sampling (with a negative control), synthetic acceptance, metric identities, one
compiled program, and refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import chi_square_pvalue, fixture_dir
from test_decoding import _primitives

from specjax import verify as verify_registry
from specjax.config import ConfigError, ModelConfig, SamplingConfig, SpecConfig
from specjax.decoding import generate, pad_request, speculative_loop
from specjax.models import hf
from specjax.models.transformer import init_model, to_decoding_layout
from specjax.proposers import build_proposer
from specjax.verify import standard
from specjax.verify.sampling import processed_probs


def perturbed(model, scale: float, seed: int = 0):
    """The model with Gaussian noise on every weight: a draft that agrees with it often, not always."""
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@functools.cache
def target_and_drafts():
    target = hf.load(fixture_dir("llama_gqa"))
    return target, {"perturbed": perturbed(target, 0.01), "unrelated": hf.load(fixture_dir("llama_mha_tied"))}


@functools.cache
def ragged_requests():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, rng.integers(1, 21)).tolist() for _ in range(56)]
    budgets = rng.integers(1, 25, len(prompts)).tolist()
    return prompts, budgets


EOS = 7


@functools.cache
def autoregressive_outputs():
    target, _ = target_and_drafts()
    prompts, budgets = ragged_requests()
    return generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS])


@pytest.mark.parametrize("num_draft", [1, 2, 4, 8])
@pytest.mark.parametrize("draft_name", ["perturbed", "unrelated"])
def test_greedy_speculative_output_is_identical_to_autoregressive(num_draft, draft_name):
    target, drafts = target_and_drafts()
    prompts, budgets = ragged_requests()
    expected = autoregressive_outputs()
    result = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS],
                      spec=SpecConfig(num_speculative_tokens=num_draft), drafter=drafts[draft_name])
    assert result.sequences() == expected.sequences()
    np.testing.assert_array_equal(result.stopped_by_eos, expected.stopped_by_eos)
    assert expected.stopped_by_eos.any()  # some rows end at an EOS inside a block
    histogram = result.metrics.summary()["length_histogram"]
    if draft_name == "perturbed":  # every acceptance length occurs, the all-accepted bonus path too
        assert all(count > 0 for count in histogram), histogram


def test_greedy_output_is_identical_with_the_attention_kernel():
    """Target and draft in the decoding layout attending through the Pallas kernel (interpreted here):
    the verification block (T = K + 1) and the decode step (T = 1) attend alike, so greedy speculative
    output is the kernel's greedy autoregressive output."""
    target, drafts = (to_decoding_layout(m, attention_kernel=True) for m in (target_and_drafts()[0],
                                                                     target_and_drafts()[1]["perturbed"]))
    prompts, budgets = (x[:16] for x in ragged_requests())
    expected = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS])
    result = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS],
                      spec=SpecConfig(num_speculative_tokens=4), drafter=drafts)
    assert result.sequences() == expected.sequences()
    assert result.metrics.summary()["mean_acceptance_length"] > 1.5  # the draft agrees often: blocks are verified


# ---------------------------------------------------------------------------------- exact distribution

TINY = ModelConfig(vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                   intermediate_size=32, init_std=0.6)
PROMPT = [1, 5, 2]
NUM_ROWS = 131_072  # >= 100k samples, one batch
NUM_TOKENS = 3


@functools.cache
def tiny_pair():
    return init_model(TINY, seed=1), init_model(TINY, seed=2)


def exact_joint(model, sampling: SamplingConfig, prompt: list[int] = PROMPT) -> np.ndarray:
    """P(t1, t2, t3 | prompt) of the target alone, from full forwards over every continuation."""
    vocab = TINY.vocab_size
    contexts = np.array([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
    positions = jnp.broadcast_to(jnp.arange(contexts.shape[1]), contexts.shape)
    logits, _, _ = model(jnp.asarray(contexts), positions)
    probs = np.asarray(processed_probs(logits, sampling), np.float64).reshape(vocab, vocab, len(prompt) + 2, vocab)
    p1 = probs[0, 0, len(prompt) - 1]
    p2 = probs[:, 0, len(prompt)]  # [t1, t2]
    p3 = probs[:, :, len(prompt) + 1]  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def speculative_joint_counts(spec: SpecConfig, sampling: SamplingConfig, drafter=None):
    """Counts of the first NUM_TOKENS tokens over NUM_ROWS rows (one batch) from the tiny target,
    drafted by the tiny draft model unless another drafter is given."""
    target, draft = tiny_pair()
    result = generate(target, [PROMPT] * NUM_ROWS, max_new_tokens=NUM_TOKENS, sampling=sampling,
                      seeds=np.arange(NUM_ROWS), cache_size=32, spec=spec,
                      drafter=draft if drafter is None else drafter)
    assert (result.num_generated == NUM_TOKENS).all()
    codes = np.ravel_multi_index(result.tokens.T, (TINY.vocab_size,) * NUM_TOKENS)
    return np.bincount(codes, minlength=TINY.vocab_size ** NUM_TOKENS), result.metrics


SAMPLINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7),
             SamplingConfig(temperature=1.0, top_k=5), SamplingConfig(temperature=1.0, top_p=0.8)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_speculative_sampling_is_lossless(method, draft_sample_method, sampling):
    spec = SpecConfig(num_speculative_tokens=2, rejection_sample_method=method,
                      draft_sample_method=draft_sample_method)
    counts, metrics = speculative_joint_counts(spec, sampling)
    assert 0 < metrics.summary()["acceptance_rate"] < 1  # both paths taken
    assert chi_square_pvalue(counts, exact_joint(tiny_pair()[0], sampling)) > 1e-3


@pytest.mark.parametrize("sampling", SAMPLINGS[:3:2], ids=str)
def test_speculative_sampling_is_lossless_with_the_pallas_kernel(sampling):
    spec = SpecConfig(num_speculative_tokens=2, rejection_sample_method="block",
                      draft_sample_method="probabilistic", verify_impl="pallas")
    counts, _ = speculative_joint_counts(spec, sampling)
    assert chi_square_pvalue(counts, exact_joint(tiny_pair()[0], sampling)) > 1e-3


def accept_all(target_probs, draft_tokens, draft_probs, keys):
    """Deliberately wrong: accepts every draft (then samples the bonus token from the target)."""
    n = jnp.full(draft_tokens.shape[:1], draft_tokens.shape[1], jnp.int32)
    return n, standard.verify(target_probs, draft_tokens, draft_probs, keys)[1]


def test_negative_control_a_verifier_that_accepts_everything_fails(monkeypatch):
    monkeypatch.setitem(verify_registry.VERIFIERS, "accept_all", accept_all)
    monkeypatch.setattr(verify_registry, "REJECTION_SAMPLE_METHODS", ("accept_all",))
    sampling = SamplingConfig(temperature=1.0)
    spec = SpecConfig(num_speculative_tokens=2, rejection_sample_method="accept_all",
                      draft_sample_method="probabilistic")
    counts, _ = speculative_joint_counts(spec, sampling)
    assert chi_square_pvalue(counts, exact_joint(tiny_pair()[0], sampling)) < 1e-6


# ------------------------------------------------------------------------------------------- synthetic

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


# ------------------------------------------------------------------------------------ one program

def test_speculative_generation_is_one_program_with_one_while_loop():
    target, drafts = target_and_drafts()
    sampling = SamplingConfig(temperature=0.8)
    spec = SpecConfig(num_speculative_tokens=3, rejection_sample_method="block",
                      draft_sample_method="probabilistic")
    request = pad_request(target, [[1, 2, 3], [4] * 9], 10, lookahead=4)
    args = (target, drafts["perturbed"], jnp.asarray(request.tokens), jnp.asarray(request.lengths),
            jnp.asarray(request.budgets), jax.vmap(jax.random.key)(jnp.asarray(request.seeds)))
    static = dict(proposer=build_proposer(spec, sampling, request.cache_size), eos_token_ids=(2,))
    prims = list(_primitives(jax.make_jaxpr(functools.partial(speculative_loop, **static))(*args).jaxpr))
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
    (dict(method="lookahead"), r"SpecConfig.method = 'lookahead' is invalid: allowed one of \['draft_model'"),
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
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\) \+ max_new_tokens \(40\) \+ K \+ 1 \(5\) = 65 "
                                         r"does not fit cache_size 64"):
        generate(target, [[1] * 20], max_new_tokens=40, cache_size=64, spec=SpecConfig(num_speculative_tokens=4),
                 drafter=drafts["perturbed"])


def _exp_output_widths(sampling: SamplingConfig) -> set[int]:
    """Last-axis sizes of every exp the speculative loop computes (softmax needs exp)."""
    target, drafts = target_and_drafts()
    spec = SpecConfig(num_speculative_tokens=3, draft_sample_method="probabilistic")
    request = pad_request(target, [[1, 2, 3]], 10, lookahead=4)
    args = (target, drafts["perturbed"], jnp.asarray(request.tokens), jnp.asarray(request.lengths),
            jnp.asarray(request.budgets), jax.vmap(jax.random.key)(jnp.asarray(request.seeds)))
    loop = functools.partial(speculative_loop, proposer=build_proposer(spec, sampling, request.cache_size),
                             eos_token_ids=())
    widths = set()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "exp":
                widths.add(eqn.outvars[0].aval.shape[-1])
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        visit(inner)

    visit(jax.make_jaxpr(loop)(*args).jaxpr)
    return widths


def test_at_temperature_zero_nothing_over_the_vocabulary_is_exponentiated():
    vocab = target_and_drafts()[0].config.vocab_size
    assert vocab not in _exp_output_widths(SamplingConfig(temperature=0.0))
    assert vocab in _exp_output_widths(SamplingConfig(temperature=1.0))  # the check can see it


def test_at_temperature_zero_every_lossless_verifier_shares_one_program():
    """At T = 0 standard and block are greedy verification: a sweep over both compiles once."""
    target, drafts = target_and_drafts()
    prompts = [[3, 9, 27], [5, 1]]
    kwargs = dict(max_new_tokens=9, drafter=drafts["perturbed"])
    first = generate(target, prompts, spec=SpecConfig(method="draft_model", num_speculative_tokens=3), **kwargs)
    compiled = speculative_loop._cache_size()
    second = generate(target, prompts, spec=SpecConfig(method="draft_model", num_speculative_tokens=3,
                                                       rejection_sample_method="block"), **kwargs)
    assert speculative_loop._cache_size() == compiled
    assert second.sequences() == first.sequences()
    generate(target, prompts, spec=SpecConfig(method="draft_model", num_speculative_tokens=3,
                                              rejection_sample_method="block"), sampling=SamplingConfig(1.0),
             **kwargs)
    assert speculative_loop._cache_size() == compiled + 1  # sampling: block is its own program

"""Sampling transforms give exactly the processed distribution (chi-square against probabilities
enumerated independently in numpy), with a negative control that the same test must reject."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.distributions import chi_square_pvalue

from specjax.config import ConfigError, SamplingConfig
from specjax.verify.sampling import categorical, processed_probs, sample

LOGITS = np.array([2.0, 1.5, 1.5, 0.3, -0.2, -1.0, 0.9, -3.0], np.float32)
NUM_SAMPLES = 200_000


def reference_probs(logits: np.ndarray, sampling: SamplingConfig) -> np.ndarray:
    """The processed distribution written out plainly (float64)."""
    z = logits.astype(np.float64) / sampling.temperature
    keep = np.ones_like(z, bool)
    if sampling.top_k:
        keep &= z >= np.sort(z)[::-1][sampling.top_k - 1]
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if sampling.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        mass_before = np.cumsum(p[order]) - p[order]
        smallest_kept = p[order][mass_before < sampling.top_p].min()
        p = np.where(p >= smallest_kept, p, 0.0)
        p /= p.sum()
    return p


def draw(sampling: SamplingConfig, seed: int = 0) -> np.ndarray:
    keys = jax.random.split(jax.random.key(seed), NUM_SAMPLES)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (NUM_SAMPLES, LOGITS.size))
    return np.asarray(jax.jit(sample, static_argnums=2)(logits, keys, sampling))


CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=1.3, top_k=3),  # the k-th largest value is tied: both kept
    SamplingConfig(temperature=1.0, top_p=0.8),
    SamplingConfig(temperature=0.8, top_k=5, top_p=0.9),
]


@pytest.mark.parametrize("sampling", CONFIGS, ids=str)
def test_samples_follow_the_processed_distribution(sampling):
    expected = reference_probs(LOGITS, sampling)
    np.testing.assert_allclose(np.asarray(processed_probs(jnp.asarray(LOGITS), sampling)), expected, atol=1e-6)
    assert chi_square_pvalue(np.bincount(draw(sampling), minlength=LOGITS.size), expected) > 1e-3


def test_negative_control_a_wrong_distribution_is_rejected():
    """The same test has the power to see a filter that was not applied."""
    counts = np.bincount(draw(SamplingConfig(temperature=1.0, top_p=0.95)), minlength=LOGITS.size)
    assert chi_square_pvalue(counts, reference_probs(LOGITS, SamplingConfig(temperature=1.0))) < 1e-6
    counts = np.bincount(draw(SamplingConfig(temperature=1.0)), minlength=LOGITS.size)
    assert chi_square_pvalue(counts, reference_probs(LOGITS, SamplingConfig(temperature=1.05))) < 1e-6


def test_top_k_keeps_ties_and_top_p_keeps_at_least_one_token():
    probs = np.asarray(processed_probs(jnp.asarray(LOGITS), SamplingConfig(temperature=1.0, top_k=2)))
    assert np.count_nonzero(probs) == 3  # 2.0, 1.5, 1.5
    probs = np.asarray(processed_probs(jnp.asarray(LOGITS), SamplingConfig(temperature=1.0, top_p=1e-6)))
    assert np.count_nonzero(probs) == 1 and probs[0] == 1.0


def test_greedy_is_the_argmax_and_ignores_keys():
    logits = jax.random.normal(jax.random.key(3), (64, 50))
    keys = jax.random.split(jax.random.key(0), 64)
    np.testing.assert_array_equal(sample(logits, keys, SamplingConfig()), np.argmax(logits, -1))
    assert processed_probs(logits, SamplingConfig()).sum(-1).tolist() == [1.0] * 64


def test_one_seed_reproduces_the_same_draws():
    sampling = SamplingConfig(temperature=1.0, top_k=4)
    np.testing.assert_array_equal(draw(sampling, seed=5), draw(sampling, seed=5))
    assert not np.array_equal(draw(sampling, seed=5), draw(sampling, seed=6))


@pytest.mark.parametrize("field, value, allowed", [
    ("temperature", -0.1, "a float >= 0"),
    ("top_k", -1, "an integer >= 0"),
    ("top_p", 0.0, r"a float in \(0, 1\]"),
    ("top_p", 1.5, r"a float in \(0, 1\]"),
])
def test_bad_sampling_values_name_the_field(field, value, allowed):
    with pytest.raises(ConfigError, match=rf"SamplingConfig.{field} = {value!r} is invalid: allowed {allowed}"):
        SamplingConfig(**{field: value})


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_categorical_draws_what_jax_random_categorical_draws(dtype):
    """The Gumbel-max draw whose argmax sharding.vocabulary_argmax takes: the same tokens bit for bit, so
    seeds give the tokens they gave through jax.random.categorical."""
    keys = jax.random.split(jax.random.key(3), 2048)
    logits = (3 * jax.random.normal(jax.random.key(1), (2048, 300))).astype(dtype)
    np.testing.assert_array_equal(np.asarray(categorical(keys, logits)),
                                  np.asarray(jax.vmap(jax.random.categorical)(keys, logits)))

"""The verifiers on their own: exact expectations from their math (Sun et al.'s example), Monte
Carlo agreement, block >= standard, one-hot equivalences, the first emitted token's distribution,
and synthetic acceptance."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.distributions import chi_square_pvalue

from specjax.verify import block, greedy, standard, synthetic
from specjax.verify.common import from_draws


def tree_distributions(vocab: int, depth: int, seed: int, peak: float = 1.0):
    """Context-dependent distributions p(. | prefix) for every prefix up to `depth` tokens."""
    rng = np.random.default_rng(seed)
    table = {}
    for length in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=length):
            logits = peak * rng.normal(size=vocab)
            table[prefix] = np.exp(logits) / np.exp(logits).sum()
    return table


def enumerate_drafts(target, draft, vocab, num_draft):
    """Every draft sequence X with its probability under the draft, and the verifier inputs."""
    sequences = list(itertools.product(range(vocab), repeat=num_draft))
    target_probs = np.array([[target[x[:i]] for i in range(num_draft + 1)] for x in sequences])
    draft_probs = np.array([[draft[x[:i]] for i in range(num_draft)] for x in sequences])
    prob = np.array([np.prod([draft[x[:i]][x[i]] for i in range(num_draft)]) for x in sequences])
    return (jnp.asarray(target_probs, jnp.float32), jnp.asarray(np.array(sequences), jnp.int32),
            jnp.asarray(draft_probs, jnp.float32), prob)


def expected_accepted_standard(target_probs, tokens, draft_probs, weights):
    a = np.asarray(jax.jit(standard.acceptance_probs)(target_probs, tokens, draft_probs), np.float64)
    return float(weights @ np.cumprod(a, axis=1).sum(axis=1))


def block_length_distribution(target_probs, tokens, draft_probs) -> np.ndarray:
    """P(tau = i), i = 0..K, with tau = max{i : eta_i <= h_i}: i is the last success."""
    h = np.asarray(jax.jit(block.stopping_probs)(target_probs, tokens, draft_probs)[0], np.float64)
    num_draft = h.shape[1]
    dist = np.zeros((h.shape[0], num_draft + 1))
    for i in range(num_draft + 1):
        later_fail = np.prod(1 - h[:, i:], axis=1)  # positions i+1..K all fail
        dist[:, i] = later_fail if i == 0 else h[:, i - 1] * later_fail
    return dist


def standard_length_distribution(target_probs, tokens, draft_probs) -> np.ndarray:
    a = np.asarray(jax.jit(standard.acceptance_probs)(target_probs, tokens, draft_probs), np.float64)
    reach = np.concatenate([np.ones((a.shape[0], 1)), np.cumprod(a, axis=1)], axis=1)  # P(n >= i)
    return reach - np.concatenate([reach[:, 1:], np.zeros((a.shape[0], 1))], axis=1)


def sample_drafts(draft, vocab, num_draft, num_samples, rng):
    """Draft sequences drawn from the context-dependent draft table (inverse CDF, every row at once)."""
    tokens = np.zeros((num_samples, num_draft), np.int32)
    code = np.zeros(num_samples, np.int64)  # each row's prefix so far, base vocab
    for i in range(num_draft):
        prefixes = itertools.product(range(vocab), repeat=i)  # in the order of their codes
        cdf = np.cumsum(np.array([draft[p] for p in prefixes]), axis=1)[code]
        tokens[:, i] = np.minimum((rng.random(num_samples)[:, None] >= cdf).sum(axis=1), vocab - 1)
        code = code * vocab + tokens[:, i]
    return tokens


SUN_TARGET, SUN_DRAFT = np.array([1 / 3, 2 / 3]), np.array([2 / 3, 1 / 3])


def sun_example():
    table = lambda probs: {prefix: probs for n in range(3) for prefix in itertools.product(range(2), repeat=n)}
    return enumerate_drafts(table(SUN_TARGET), table(SUN_DRAFT), vocab=2, num_draft=2)


def test_sun_et_al_example_expected_accepted_tokens_exactly():
    target_probs, tokens, draft_probs, weights = sun_example()
    assert expected_accepted_standard(target_probs, tokens, draft_probs, weights) == pytest.approx(10 / 9, abs=1e-6)
    lengths = block_length_distribution(target_probs, tokens, draft_probs)
    assert float(weights @ (lengths @ np.arange(3))) == pytest.approx(11 / 9, abs=1e-6)


@pytest.mark.parametrize("verifier, expected", [(standard.verify, 10 / 9), (block.verify, 11 / 9)])
def test_sun_et_al_example_monte_carlo(verifier, expected):
    num_samples = 200_000
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.choice(2, size=(num_samples, 2), p=SUN_DRAFT), jnp.int32)
    target_probs = jnp.broadcast_to(jnp.asarray(SUN_TARGET, jnp.float32), (num_samples, 3, 2))
    draft_probs = jnp.broadcast_to(jnp.asarray(SUN_DRAFT, jnp.float32), (num_samples, 2, 2))
    keys = jax.random.split(jax.random.key(1), num_samples)
    n, _ = jax.jit(verifier)(target_probs, tokens, draft_probs, keys)
    assert float(jnp.mean(n)) == pytest.approx(expected, abs=0.01)  # std error ~0.002


@pytest.mark.parametrize("seed", range(4))
def test_block_never_accepts_less_than_standard_in_expectation(seed):
    target = tree_distributions(3, 3, seed=seed)
    draft = tree_distributions(3, 3, seed=100 + seed)
    target_probs, tokens, draft_probs, weights = enumerate_drafts(target, draft, 3, 3)
    lengths = block_length_distribution(target_probs, tokens, draft_probs)
    block_mean = float(weights @ (lengths @ np.arange(4)))
    standard_mean = expected_accepted_standard(target_probs, tokens, draft_probs, weights)
    assert block_mean >= standard_mean - 1e-6
    assert block_mean > standard_mean + 1e-3  # strictly better on generic distributions


@pytest.mark.parametrize("seed", range(3))
def test_with_one_hot_drafts_block_and_standard_agree(seed):
    rng = np.random.default_rng(seed)
    batch, num_draft, vocab = 64, 4, 5
    target_probs = jnp.asarray(rng.dirichlet(np.ones(vocab), size=(batch, num_draft + 1)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, num_draft)), jnp.int32)
    np.testing.assert_allclose(block_length_distribution(target_probs, tokens, None),
                               standard_length_distribution(target_probs, tokens, None), atol=1e-6)


@pytest.mark.parametrize("verifier", [standard.verify, block.verify])
@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_on_a_one_hot_target_every_verifier_is_greedy(verifier, one_hot_draft):
    """At temperature 0 the processed target is one-hot; then standard and block reduce to greedy."""
    rng = np.random.default_rng(3)
    batch, num_draft, vocab = 512, 4, 6
    argmax = rng.integers(0, vocab, (batch, num_draft + 1))
    target_probs = jax.nn.one_hot(argmax, vocab)
    # Drafts that agree with the argmax for a random prefix, then not.
    agree = rng.integers(0, num_draft + 1, batch)
    tokens = np.where(np.arange(num_draft) < agree[:, None], argmax[:, :-1], (argmax[:, :-1] + 1) % vocab)
    draft_probs = None if one_hot_draft else jax.nn.one_hot(tokens, vocab) * 0.5 + 0.5 / vocab
    keys = jax.random.split(jax.random.key(0), batch)
    got = jax.jit(verifier)(target_probs, jnp.asarray(tokens), draft_probs, keys)
    want = jax.jit(greedy.verify)(target_probs, jnp.asarray(tokens))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(want[0]), agree)


def accept_all(target_probs, draft_tokens, draft_probs, keys):
    """A deliberately wrong verifier: every draft is accepted, the bonus token is sampled."""
    n = jnp.full(draft_tokens.shape[:1], draft_tokens.shape[1], jnp.int32)
    return n, standard.verify(target_probs, draft_tokens, draft_probs, keys)[1]


@pytest.mark.parametrize("verifier, lossless", [(standard.verify, True), (block.verify, True), (accept_all, False)])
@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_first_emitted_token_follows_the_target(verifier, lossless, one_hot_draft):
    """The first token a step emits (X_1 if accepted, else the correction) is distributed as p(. | root)."""
    vocab, num_draft, num_samples = 4, 3, 40_000
    target, draft = tree_distributions(vocab, num_draft, seed=7), tree_distributions(vocab, num_draft, seed=8)
    rng = np.random.default_rng(5)
    if one_hot_draft:  # a deterministic drafter: the draft's argmax path
        prefix = ()
        for _ in range(num_draft):
            prefix += (int(np.argmax(draft[prefix])),)
        tokens = np.tile(np.array(prefix, np.int32), (num_samples, 1))
    else:
        tokens = sample_drafts(draft, vocab, num_draft, num_samples, rng)
    paths, row_path = np.unique(tokens, axis=0, return_inverse=True)  # at most vocab ** num_draft distinct rows
    prefixes = [[tuple(int(t) for t in path[:i]) for i in range(num_draft + 1)] for path in paths]
    target_probs = jnp.asarray(np.array([[target[p] for p in ps] for ps in prefixes])[row_path.ravel()], jnp.float32)
    draft_probs = None if one_hot_draft else jnp.asarray(
        np.array([[draft[p] for p in ps[:-1]] for ps in prefixes])[row_path.ravel()], jnp.float32)
    keys = jax.random.split(jax.random.key(2), num_samples)
    n, next_token = jax.jit(verifier)(target_probs, jnp.asarray(tokens), draft_probs, keys)
    first = np.where(np.asarray(n) >= 1, tokens[:, 0], np.asarray(next_token))
    pvalue = chi_square_pvalue(np.bincount(first, minlength=vocab), target[()])
    assert (pvalue > 1e-3) if lossless else (pvalue < 1e-6)


def test_verifiers_reproduce_from_the_same_draws():
    rng = np.random.default_rng(9)
    batch, num_draft, vocab = 16, 4, 10
    target_probs = jnp.asarray(rng.dirichlet(np.ones(vocab), size=(batch, num_draft + 1)), jnp.float32)
    draft_probs = jnp.asarray(rng.dirichlet(np.ones(vocab), size=(batch, num_draft)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, num_draft)), jnp.int32)
    keys = jax.random.split(jax.random.key(4), batch)
    for module in (standard, block):
        a = jax.jit(module.verify)(target_probs, tokens, draft_probs, keys)
        b = jax.jit(from_draws(module.verify_with_draws))(target_probs, tokens, draft_probs, keys)
        np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
        np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


def test_synthetic_acceptance_follows_the_rates():
    rates = (0.9, 0.6, 0.6, 0.1)
    batch = 100_000
    verify = from_draws(lambda *args: synthetic.verify_with_draws(*args, rates=rates))
    target_probs = jnp.full((batch, 5, 3), 1 / 3)
    n, _ = jax.jit(verify)(target_probs, jnp.zeros((batch, 4), jnp.int32), None,
                           jax.random.split(jax.random.key(0), batch))
    reached = [(np.asarray(n) >= i + 1).mean() for i in range(4)]
    np.testing.assert_allclose(reached, rates, atol=0.005)


def test_synthetic_greedy_rows_read_argmaxes_and_sampled_rows_race_with_the_common_draws():
    """Every row greedy, verify_drafts gives synthetic acceptance the target's argmaxes (no one-hot rows, no
    exponential drawn a vocabulary entry): the lengths and tokens are the race's over the one-hot rows. Sampled rows
    race with common.make_draws' draws, as the verifiers do."""
    from specjax.verify.common import leading_true, make_draws, race_sample

    batch, num_draft, vocab, rates = 512, 4, 50, (0.9, 0.6, 0.6, 0.1)
    logits = jax.random.normal(jax.random.key(3), (batch, num_draft + 1, vocab))
    drafts, keys = jnp.zeros((batch, num_draft), jnp.int32), jax.random.split(jax.random.key(4), batch)
    keyed = from_draws(lambda *args: synthetic.verify_with_draws(*args, rates=rates))
    verify = jax.jit(lambda target: keyed(target, drafts, None, keys))
    argmax = jnp.argmax(logits, axis=-1)
    n, token = verify(argmax)
    raced = verify(jax.nn.one_hot(argmax, vocab))
    np.testing.assert_array_equal(np.asarray(n), np.asarray(raced[0]))
    np.testing.assert_array_equal(np.asarray(token), np.asarray(raced[1]))
    assert 0 < np.asarray(n).mean() < num_draft  # lengths of every size: tokens read at several positions

    probs = jax.nn.softmax(logits, axis=-1)
    draws = make_draws(keys, num_draft, vocab)
    want_n = leading_true(draws.uniforms < jnp.asarray(synthetic.conditional_rates(rates), jnp.float32))
    want_token = race_sample(probs[jnp.arange(batch), want_n], draws.exponentials)
    got_n, got_token = verify(probs)
    np.testing.assert_array_equal(np.asarray(got_n), np.asarray(want_n))
    np.testing.assert_array_equal(np.asarray(got_token), np.asarray(want_token))
    assert (np.asarray(got_token) != np.asarray(token)).any()  # the sampled rows' tokens are drawn, not the argmax


def test_race_sample_never_picks_a_zero_weight_token_even_when_its_clock_is_zero():
    from specjax.verify.common import race_sample

    weights = jnp.asarray([[0.0, 0.3, 0.7, 0.0]])
    for exponentials in ([0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 2.0, 0.5, 0.0]):
        token = int(race_sample(weights, jnp.asarray([exponentials]))[0])
        assert weights[0, token] > 0
    assert int(race_sample(weights, jnp.asarray([[1.0, 0.0, 1.0, 1.0]]))[0]) == 1  # a zero clock fires first

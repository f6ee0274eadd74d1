"""Exact distributions and the test that compares counts with them: the chi-square p-value, a tiny
target over 8 token ids whose first three tokens can be enumerated, and the speculative counts to
compare with its joint distribution (all sampling settings of a case through one program: they are data)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import verify as verify_registry
from specjax.config import ModelConfig, SamplingConfig, SpecConfig
from specjax.decoding import bucket, generate, speculative_loop
from specjax.metrics import AcceptanceMetrics
from specjax.models.transformer import init_model
from specjax.verify import tree as tree_verify
from specjax.verify.sampling import processed_probs


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of observed counts to exact probabilities. Outcomes expected fewer
    than min_expected times are pooled into one cell (the test's approximation needs that); any count
    where the probability is zero gives 0 (an impossible outcome was drawn)."""
    from scipy import stats  # scipy only where a test counts

    counts, probs = np.asarray(counts).ravel(), np.asarray(probs, np.float64).ravel()
    if np.any(counts[probs == 0]):
        return 0.0
    support = probs > 0
    counts, probs = counts[support], probs[support]
    expected = probs / probs.sum() * counts.sum()
    rare = expected < min_expected
    if rare.any():
        counts = np.append(counts[~rare], counts[rare].sum())
        expected = np.append(expected[~rare], expected[rare].sum())
    return float(stats.chisquare(counts, expected).pvalue)


TINY = ModelConfig(vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                   intermediate_size=32, init_std=0.6)
PROMPT = [1, 5, 2]
# Rows per sampling setting in the losslessness tests. On the CPU 8,192 (their run time was most of the suite's):
# at p > 1e-4 over the ~35 pooled cells they catch a chi-square divergence from the target of 0.01 with probability
# 0.99 (0.005: 0.5); the negative controls' divergences are 0.023 (test_adaptive.py's) to 49, p 1e-22 to below
# 1e-300 (measured 2026-12-04). On a GPU 131,072: the top-p miscompilation docs/testing.md tells of showed there
# only from about 20,000 rows on.
NUM_ROWS = 8_192 if jax.default_backend() == "cpu" else 131_072
NUM_TOKENS = 3
# The rows run CHUNK_ROWS at a time: a batch of all of them (131,136 for four settings) is padded to the next
# power of two (twice the rows), and runs slower a row besides (docs/performance.md, "The test suite on the CPU").
CHUNK_ROWS = 4096
MIN_CACHE = 16  # the prefill's width (the prompt bucket), and room for every tree of the suite's cases


@functools.cache
def tiny_pair():
    """A target and a draft model over 8 token ids, whose first three tokens can be enumerated."""
    return init_model(TINY, seed=1), init_model(TINY, seed=2)


@functools.partial(jax.jit, static_argnames="sampling")
def processed_continuations(model, contexts, sampling: SamplingConfig):
    """The processed distribution at every position of every context: one program (run op by op, the forward
    took seconds per call)."""
    positions = jnp.broadcast_to(jnp.arange(contexts.shape[1]), contexts.shape)
    logits, _, _ = model(contexts, positions)
    return processed_probs(logits, sampling)


def exact_joint(model, sampling: SamplingConfig, prompt: list[int] = PROMPT) -> np.ndarray:
    """P(t1, t2, t3 | prompt) of the target alone, from full forwards over every continuation."""
    vocab = TINY.vocab_size
    contexts = np.array([prompt + [a, b] for a in range(vocab) for b in range(vocab)], np.int32)
    probs = np.asarray(processed_continuations(model, contexts, sampling), np.float64).reshape(
        vocab, vocab, len(prompt) + 2, vocab)
    p1 = probs[0, 0, len(prompt) - 1]
    p2 = probs[:, 0, len(prompt)]  # [t1, t2]
    p3 = probs[:, :, len(prompt) + 1]  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def joint_counts_by_sampling(spec: SpecConfig, samplings, drafter, prompt: list[int] = PROMPT, greedy_rows: int = 0,
                             **options):
    """Counts of the first NUM_TOKENS tokens from the tiny target, NUM_ROWS rows for each of `samplings`,
    with `greedy_rows` greedy rows among them, all through one compiled loop (the settings are data; asserted),
    CHUNK_ROWS rows a call; options: generate's (e.g. cost_curve). Returns ([counts per sampling], metrics of
    every row, the greedy rows' tokens [greedy_rows, N])."""
    # Row i draws with seed i: the greedy rows, then NUM_ROWS rows of each setting. They run interleaved
    # (every chunk holds every setting: one sampling mode, one program), the last chunk filled with rows of
    # budget 0 (done at the prefill) to CHUNK_ROWS: one batch shape.
    configs = [SamplingConfig()] * greedy_rows + [s for s in samplings for _ in range(NUM_ROWS)]
    order = np.concatenate([np.arange(greedy_rows),
                            greedy_rows + np.arange(len(samplings) * NUM_ROWS).reshape(len(samplings), -1).T.ravel()])
    filler = -len(order) % CHUNK_ROWS
    row_configs = [configs[i] for i in order] + [samplings[i % len(samplings)] for i in range(filler)]
    budgets = np.concatenate([np.full(len(order), NUM_TOKENS), np.zeros(filler, np.int64)])
    seeds = np.concatenate([order, np.zeros(filler, np.int64)])
    cache_size = bucket(len(prompt) + NUM_TOKENS + spec.num_draft_nodes + 1, MIN_CACHE)
    results, programs = [], []
    for start in range(0, len(row_configs), CHUNK_ROWS):
        chunk = slice(start, start + CHUNK_ROWS)
        results.append(generate(tiny_pair()[0], [prompt] * CHUNK_ROWS, max_new_tokens=budgets[chunk],
                                sampling=row_configs[chunk], seeds=seeds[chunk], cache_size=cache_size, spec=spec,
                                drafter=drafter, **options))
        programs.append(speculative_loop._cache_size())
    assert programs == programs[:1] * len(programs), "a chunk compiled a loop of its own"
    real = slice(0, len(order))
    tokens, num_generated = np.empty((len(order), NUM_TOKENS), np.int64), np.empty(len(order), np.int64)
    tokens[order] = np.concatenate([result.tokens for result in results])[real]
    num_generated[order] = np.concatenate([result.num_generated for result in results])[real]
    assert (num_generated == NUM_TOKENS).all()
    metrics = AcceptanceMetrics(**{
        field.name: place(order, np.concatenate([getattr(result.metrics, field.name) for result in results])[real])
        for field in dataclasses.fields(AcceptanceMetrics)})
    codes = np.ravel_multi_index(tokens[greedy_rows:].T, (TINY.vocab_size,) * NUM_TOKENS)
    counts = [np.bincount(part, minlength=TINY.vocab_size ** NUM_TOKENS) for part in np.split(codes, len(samplings))]
    return counts, metrics, tokens[:greedy_rows]


def place(order: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows given in `order`, put back at their own indices."""
    placed = np.empty_like(rows)
    placed[order] = rows
    return placed


def speculative_joint_counts(spec: SpecConfig, sampling: SamplingConfig, drafter, prompt: list[int] = PROMPT):
    """Counts of the first NUM_TOKENS tokens over NUM_ROWS rows from the tiny target."""
    counts, metrics, _ = joint_counts_by_sampling(spec, [sampling], drafter, prompt)
    return counts[0], metrics


def first_ranked(target_probs, tokens, parents, draft_probs, keys):
    """A tree verifier that is deliberately wrong (the trees' negative control): accepts the first child at every
    depth, then samples from the target there."""
    path, length, _ = tree_verify.verify_tree_greedy(jnp.zeros(target_probs.shape[:2], jnp.int32), tokens * 0, parents)
    last = jnp.take_along_axis(target_probs, (1 + jnp.maximum(path, 0))[:, :, None], 1)[jnp.arange(tokens.shape[0]),
                                                                                         jnp.maximum(length - 1, 0)]
    return path, length, jax.vmap(jax.random.categorical)(keys, jnp.log(last))


def first_ranked_pvalue(monkeypatch, spec: SpecConfig, drafter) -> float:
    """The chi-square p-value at T 1 of a tree spec decoded with the 'standard' tree verifier replaced by
    first_ranked (its own compiled loop: the loop's cache is cleared before and after)."""
    rule = verify_registry.VERIFIERS["standard"]
    monkeypatch.setitem(verify_registry.VERIFIERS, "standard", verify_registry.Verifier(chain=rule.chain,
                                                                                        tree=first_ranked))
    sampling = SamplingConfig(temperature=1.0)
    speculative_loop.clear_cache()  # the one program the patched rule is traced into
    try:
        counts, _ = speculative_joint_counts(spec, sampling, drafter)
    finally:
        speculative_loop.clear_cache()
    return chi_square_pvalue(counts, exact_joint(tiny_pair()[0], sampling))


def tree_joint_counts(spec: SpecConfig, samplings, drafter, verifiers=("standard", "block")):
    """{verifier: counts per sampling setting}: every setting of `samplings` through one program, once per verifier;
    the verifier is data of the loop, so the second run compiles nothing (checked)."""
    counts, programs = {}, []
    for verifier in verifiers:
        counts[verifier], metrics, _ = joint_counts_by_sampling(
            dataclasses.replace(spec, rejection_sample_method=verifier), samplings, drafter)
        programs.append(speculative_loop._cache_size())
        assert 0 < metrics.summary()["acceptance_rate"] < 1, verifier
    assert programs == programs[:1] * len(programs)
    return counts


def check_lossless(counts, samplings):
    """Every verifier's counts of every sampling setting follow the tiny target (p-value > 1e-4)."""
    for verifier, by_sampling in counts.items():
        for sampling, sampling_counts in zip(samplings, by_sampling):
            p_value = chi_square_pvalue(sampling_counts, exact_joint(tiny_pair()[0], sampling))
            assert p_value > 1e-4, (verifier, sampling, p_value)

"""N-gram prompt lookup (method "ngram"): the lookup on hand-made buffers, high acceptance where the
target's continuation is in the context, one compiled program, and refusals. Greedy equality and
lossless sampling: tests/test_lossless.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import fixture_dir
from support.jaxpr import primitives, speculative_loop_args

from specjax.config import ConfigError, SamplingConfig, SpecConfig
from specjax.decoding import generate, speculative_loop
from specjax.models import hf
from specjax.proposers import Context, build_proposer, check_spec


@functools.cache
def target():
    return hf.load(fixture_dir("llama_gqa"))


def ngram_spec(num_draft: int, lookup_min: int, lookup_max: int, **kwargs) -> SpecConfig:
    return SpecConfig(method="ngram", num_speculative_tokens=num_draft, prompt_lookup_min=lookup_min,
                      prompt_lookup_max=lookup_max, **kwargs)


def propose(rows: list[list[int]], num_draft: int, lookup_min: int, lookup_max: int, width: int = 24) -> list:
    """Drafts for ragged rows, padded with a copy of the row so that a lookup past the committed
    length would find (wrong) matches."""
    tokens = np.array([(row * width)[:width] for row in rows], np.int32)
    proposer = build_proposer(ngram_spec(num_draft, lookup_min, lookup_max), SamplingConfig(), width)
    context = Context.of(jnp.asarray(tokens), jnp.array([len(row) for row in rows], jnp.int32))
    keys = jax.random.split(jax.random.key(0), len(rows))
    draft, draft_probs, state = jax.jit(proposer.propose)(None, proposer.init(None, None, None, None), context, keys)
    assert draft_probs is None and state == ()
    assert draft.shape == (len(rows), num_draft) and draft.dtype == jnp.int32
    return np.asarray(draft).tolist()


# ------------------------------------------------------------------------------------------ lookup

SUFFIX_FOLLOWED = [10, 4, 7, 9, 3, 8, 1, 2, 7, 9, 3]  # 7 9 3 ends at 4, followed by 8 1 2
TWO_OCCURRENCES = [7, 9, 3, 5, 6, 7, 9, 3, 11, 12, 0, 7, 9, 3]  # ends at 2 and 7: 7 wins
NESTED = [1, 2, 3, 40, 5, 2, 3, 41, 6, 3, 42, 1, 2, 3]  # "1 2 3" at 2, "2 3" last at 6, "3" last at 9
NO_MATCH = [1, 2, 3, 4, 5, 6]
PERIODIC = [5, 6, 5, 6, 5]  # only 2 tokens follow "5 6 5": the lookup continues with its own draft


def test_the_tokens_after_the_most_recent_earlier_occurrence_are_the_draft():
    assert propose([SUFFIX_FOLLOWED], 3, 3, 3) == [[8, 1, 2]]
    assert propose([TWO_OCCURRENCES], 3, 3, 3) == [[11, 12, 0]]


def test_the_longest_n_that_matches_wins():
    assert propose([NESTED], 3, 1, 3) == [[40, 5, 2]]
    assert propose([NESTED], 3, 1, 2) == [[41, 6, 3]]
    assert propose([NESTED], 3, 1, 1) == [[42, 1, 2]]
    assert propose([NESTED], 3, 4, 5) == [[0, 0, 0]]  # no 4-gram repeats


def test_a_short_tail_is_continued_with_its_period():
    assert propose([PERIODIC], 5, 3, 3) == [[6, 5, 6, 5, 6]]
    assert propose([[3, 8, 9, 3]], 5, 1, 1) == [[8, 9, 3, 8, 9]]


def test_rows_of_different_lengths_in_one_batch():
    rows = [SUFFIX_FOLLOWED, TWO_OCCURRENCES, NESTED, NO_MATCH, PERIODIC, [4], [4, 4]]
    assert propose(rows, 3, 1, 3) == [[8, 1, 2], [11, 12, 0], [40, 5, 2], [0, 0, 0], [6, 5, 6], [0, 0, 0],
                                      [4, 4, 4]]
    # The same rows cut shorter: nothing at or after the committed length is looked at.
    assert propose([row[:-1] for row in rows[:3]], 3, 2, 3) == [[3, 8, 1], [3, 11, 12], [3, 40, 5]]


@pytest.mark.loop
def test_a_draft_without_a_match_is_rejected_and_the_target_token_emitted():
    rng = np.random.default_rng(3)
    # Distinct prompt tokens and min n 2: the suffix (last prompt token, first new token) has no
    # earlier occurrence, so the single step drafts zeros.
    prompts = [rng.permutation(np.arange(1, 128))[:rng.integers(4, 12)].tolist() for _ in range(6)]
    expected = generate(target(), prompts, max_new_tokens=2)
    assert all(row[1] != 0 for row in expected.sequences())  # the target never picks the zero draft
    result = generate(target(), prompts, max_new_tokens=2, spec=ngram_spec(3, 2, 3))
    assert result.sequences() == expected.sequences()
    np.testing.assert_array_equal(result.metrics.steps, 1)
    np.testing.assert_array_equal(result.metrics.accepted, 0)


# -------------------------------------------------------------------------------------- repetition

@pytest.mark.loop
@pytest.mark.parametrize("num_draft, min_length", [(2, 2.5), (5, 4.5)])
def test_acceptance_is_high_when_the_continuation_is_in_the_context(num_draft, min_length):
    # The random llama_gqa fixture does not copy from its context: after P + G + P (G its greedy
    # continuation of P) it does not say G again. The mistral fixture has a sliding window of 5 over
    # 2 layers, so its next token depends on the last 9 tokens only (RoPE is relative): with
    # len(P) >= 9 its greedy continuation of P + G + P is G again, which n-gram lookup finds.
    model = hf.load(fixture_dir("mistral"))
    assert model.config.sliding_window == 5 and model.config.num_layers == 2
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, rng.integers(12, 20)).tolist() for _ in range(16)]
    continuations = generate(model, prompts, max_new_tokens=32).sequences()
    repeated = [p + g + p for p, g in zip(prompts, continuations)]
    expected = generate(model, repeated, max_new_tokens=32)
    assert np.mean([e == g for e, g in zip(expected.sequences(), continuations)]) >= 0.75  # the premise
    result = generate(model, repeated, max_new_tokens=32, spec=ngram_spec(num_draft, 2, 5))
    assert result.sequences() == expected.sequences()
    # Measured 2.91 (K = 2) and 5.33 (K = 5): every step but the last of a row accepts all K.
    assert result.metrics.summary()["mean_acceptance_length"] > min_length


# ------------------------------------------------------------------------------------- one program

@pytest.mark.loop
def test_ngram_generation_is_one_program_with_one_while_loop():
    spec, sampling = ngram_spec(3, 1, 3), SamplingConfig(temperature=0.8)
    args, static = speculative_loop_args(target(), None, [[1, 2, 3], [4] * 9], 10, spec, sampling, eos_token_ids=(2,))
    prims = primitives(jax.make_jaxpr(functools.partial(speculative_loop, **static))(*args).jaxpr)
    assert [name for name, depth in prims if name == "while" and depth == 1] == ["while"]
    assert not [name for name, _ in prims if "callback" in name or "feed" in name]


# ---------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("lookup_min, lookup_max, message", [
    (4, 2, r"SpecConfig.prompt_lookup_max = 2 is invalid: allowed an integer >= prompt_lookup_min \(4\)"),
    (0, 2, r"SpecConfig.prompt_lookup_min = 0 is invalid: allowed an integer >= 1"),
])
def test_bad_lookup_lengths_are_refused(lookup_min, lookup_max, message):
    with pytest.raises(ConfigError, match=message):
        check_spec(ngram_spec(2, lookup_min, lookup_max))


def test_drafter_weights_are_refused():
    with pytest.raises(ValueError, match=r"method 'ngram' .* takes no drafter weights: allowed drafter=None, "
                                         r"got Transformer"):
        generate(target(), [[1, 2]], max_new_tokens=4, spec=ngram_spec(2, 1, 3), drafter=target())

"""Every drafter is lossless. Greedy: speculative output identical to autoregressive, token for token
(ragged prompts, EOS inside blocks). Sampling: the joint distribution of the first three tokens over
8,192 rows per setting (131,072 on a GPU) equals the target's enumerated one (chi-square), and negative
controls fail the same test. One test each, parametrised over drafters x drafting x settings; each
drafter's own tests (layouts, checkpoints, what its drafts are) live in its file.

A sampling case runs every verifier the drafter has (standard and block, or block alone where the case is
about the block verifier) on rows of all its sampling settings, run in chunks through one compiled loop
(the verifier and the settings are data; asserted)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from support.distributions import (NUM_TOKENS, PROMPT, TINY, chi_square_pvalue, exact_joint, joint_counts_by_sampling,
                                   speculative_joint_counts, tiny_pair)
from support.models import (EOS, FR_IDS, HEADS, METHOD, dflash_config, dspark_drafter, eagle_config, head_for,
                            medusa_for, mtp_modules, target_and_drafts, trained_dflash)
from support.requests import REQUESTS, autoregressive_outputs

from specjax import verify as verify_registry
from specjax.config import SamplingConfig, SpecConfig
from specjax.decoding import generate, speculative_loop
from specjax.models.dflash import drafter_to_decoding_layout, init_dflash
from specjax.models.dflash import with_draft_vocabulary as dflash_with_draft_vocabulary
from specjax.models.eagle import init_eagle, with_draft_vocabulary
from specjax.models.transformer import to_decoding_layout
from specjax.verify import standard

pytestmark = pytest.mark.loop  # every case decodes through the speculative loop (tests/conftest.py: tiers)

# Drafter name -> SpecConfig.method ("perturbed" and "unrelated": draft models of target_and_drafts()).
METHODS = {"draft_model": "draft_model", "perturbed": "draft_model", "unrelated": "draft_model", **METHOD,
           "medusa": "medusa", "ngram": "ngram", "dflash": "dflash", "dflash_fr": "dflash"}


# ---------------------------------------------------------------------------- greedy = autoregressive

@functools.cache
def greedy_drafter(name: str, attention_kernel: bool = False):
    """The drafter's weights for target_and_drafts()'s target (None for n-gram lookup)."""
    target, drafts = target_and_drafts()
    if name in drafts:
        return to_decoding_layout(drafts[name], attention_kernel=True) if attention_kernel else drafts[name]
    if name == "dflash":
        return drafter_to_decoding_layout(trained_dflash()) if attention_kernel else trained_dflash()
    if name == "dflash_fr":  # FR-Spec: half the target's ids
        return dflash_with_draft_vocabulary(trained_dflash(), FR_IDS)
    if name == "medusa":
        return medusa_for(target, num_heads=3, num_layers=2, scale=0.05)
    return None if name == "ngram" else head_for(name)


@functools.cache
def kernel_autoregressive_outputs(requests: str):
    """The greedy autoregressive output of the target in the decoding layout, attending through the
    Pallas kernel (interpreted on the CPU)."""
    prompts, budgets = REQUESTS[requests]()
    target = to_decoding_layout(target_and_drafts()[0], attention_kernel=True)
    return generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS])


def every_length_occurs(result, expected, drafter):
    histogram = result.metrics.summary()["length_histogram"]  # the all-accepted bonus path too
    assert all(count > 0 for count in histogram), histogram


def accepts_often(result, expected, drafter):  # the draft agrees often: blocks are verified
    assert result.metrics.summary()["mean_acceptance_length"] > 1.5


def accepts_sometimes(result, expected, drafter):
    assert 0 < result.metrics.summary()["acceptance_rate"] < 1


def emits_ids_the_head_cannot_draft(result, expected, drafter):
    """The target emits tokens outside the head's draft vocabulary (FR-Spec)."""
    draftable = set(jax.device_get(drafter.draft_to_target[...]).tolist())
    assert {t for row in expected.sequences() for t in row} - draftable


def nothing_more(result, expected, drafter):
    pass


def greedy_case(drafter: str, num_draft: int, check=nothing_more, requests: str = "ragged",
                attention_kernel: bool = False, tag: str = "", **options):
    """A parameter set, named e.g. "draft_model-perturbed-K4-float8_cache" or "eagle_fr-K1"."""
    spec = SpecConfig(method=METHODS.get(drafter, drafter), num_speculative_tokens=num_draft, **options)
    name = f"{spec.method}-{drafter}" if spec.method == "draft_model" else drafter
    return pytest.param(drafter, spec, requests, attention_kernel, check,
                        id="-".join([name, f"K{num_draft}", *([tag] if tag else [])]))


GREEDY_CASES = [
    # A close draft model at every K; an unrelated one (MHA, tied embeddings: drafts mostly rejected) at one.
    *(greedy_case("perturbed", k, every_length_occurs) for k in (1, 2, 4, 8)),
    greedy_case("unrelated", 4),
    # A float8 draft cache still drafts well.
    greedy_case("perturbed", 4, accepts_often, tag="float8_cache", kv_cache_dtype="float8_e4m3fn"),
    # Target and draft in the decoding layout attending through the Pallas kernel: the verification
    # block (T = K + 1) and the decode step (T = 1) attend alike.
    greedy_case("perturbed", 4, accepts_often, requests="ragged16", attention_kernel=True, tag="attention_kernel"),
    *(greedy_case(name, k) for name in ("eagle", "eagle3") for k in (1, 4)),
    greedy_case("eagle_fr", 4, emits_ids_the_head_cannot_draft),  # FR-Spec drafts the same way at every K
    # EAGLE-2 dynamic trees (these random heads' paths are accepted one draft deep now and then; the bundled
    # heads' deeper paths: tests/test_default_models.py).
    *(greedy_case(name, 4, accepts_sometimes, tag="tree12-top3", total_tokens=12, tree_top_k=3)
      for name in ("eagle", "eagle3")),
    greedy_case("perturbed", 4, every_length_occurs, tag="tree12-top3", total_tokens=12, tree_top_k=3),
    # ... with the tree's mask in the Pallas kernel (the target's 13-token verification block).
    greedy_case("perturbed", 4, accepts_often, requests="ragged16", attention_kernel=True,
                tag="tree12-top3-attention_kernel", total_tokens=12, tree_top_k=3),
    *(greedy_case("medusa", k, accepts_sometimes) for k in (1, 3)),
    # One forward drafts the block; K up to the block's 15. The fixture target is random, and a drafter
    # trained on its text accepts little (tests/test_train_dflash.py trains one for a target with structure).
    *(greedy_case("dflash", k, accepts_sometimes) for k in (4, 15)),  # K 8: through the kernel and with FR-Spec
    greedy_case("dflash", 4, accepts_sometimes, tag="K_masks", dflash_full_block=False),  # the default: full block
    greedy_case("dflash", 8, accepts_sometimes, requests="ragged16", attention_kernel=True, tag="attention_kernel"),
    greedy_case("dflash_fr", 8, emits_ids_the_head_cannot_draft),
    *(greedy_case("ngram", k, accepts_sometimes, requests="repeating", tag=f"lookup{lo}to{hi}",
                  prompt_lookup_min=lo, prompt_lookup_max=hi) for k, lo, hi in ((2, 1, 3), (5, 2, 4))),
]


@pytest.mark.parametrize("drafter, spec, requests, attention_kernel, check", GREEDY_CASES)
def test_greedy_speculative_output_is_identical_to_autoregressive(drafter, spec, requests, attention_kernel, check):
    target = target_and_drafts()[0]
    expected = autoregressive_outputs(requests)
    if attention_kernel:
        target, expected = to_decoding_layout(target, attention_kernel=True), kernel_autoregressive_outputs(requests)
    weights = greedy_drafter(drafter, attention_kernel)
    prompts, budgets = REQUESTS[requests]()
    result = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS], spec=spec, drafter=weights)
    assert result.sequences() == expected.sequences()
    assert (result.stopped_by_eos == expected.stopped_by_eos).all()
    assert expected.stopped_by_eos.any()  # some rows end at an EOS inside a block
    check(result, expected, weights)


# ------------------------------------------------------------------------------ exact distribution

def tiny_drafter(name: str):
    """The drafter's weights for the tiny target of tiny_pair() (None for n-gram lookup)."""
    if name == "draft_model":  # another random model of the same shape
        return tiny_pair()[1]
    if name == "medusa":
        return medusa_for(tiny_pair()[0], num_heads=2, scale=0.5)
    if name == "ngram":
        return None
    if name in ("dflash", "dflash_fr"):  # the tiny target has one layer: its output (the final hidden state)
        drafter = init_dflash(dflash_config(TINY, (0,), block_size=4), seed=5)
        return dflash_with_draft_vocabulary(drafter, [1, 2, 4, 7]) if name == "dflash_fr" else drafter
    kwargs = dict(HEADS[METHOD[name]])
    if name == "eagle3":
        kwargs["draft_vocab_size"] = 6  # a reduced draft vocabulary: two target ids never drafted
        kwargs["fuse_layers"] = (0, 1, 1)  # the tiny target has one layer
    head = init_eagle(eagle_config(TINY, **kwargs), seed=4)
    return with_draft_vocabulary(head, [1, 2, 4, 7]) if name == "eagle_fr" else head  # half the 8 ids


SAMPLINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7),
             SamplingConfig(temperature=1.0, top_k=5), SamplingConfig(temperature=1.0, top_p=0.8)]
T1 = SAMPLINGS[0]
REPEATING_PROMPT = [0, 0, 1] * 3  # the tiny target often continues it: a third of n-gram drafts accepted


def sampling_id(sampling: SamplingConfig) -> str:
    return "-".join([f"T{sampling.temperature}", *([f"top_k{sampling.top_k}"] if sampling.top_k else []),
                     *([f"top_p{sampling.top_p}"] if sampling.top_p < 1 else [])])


def lossless_case(drafter: str, verifiers=("standard", "block"), drafting: str = "probabilistic", samplings=(T1,),
                  prompt=PROMPT, tag: str = "", **options):
    """A parameter set, named drafter-drafting[-verifier][-tag], e.g. "eagle3-probabilistic-block": every sampling
    setting of `samplings` runs through one program, beside greedy rows, once per verifier of `verifiers` (the verifier is
    data of the loop: one compiled program serves them all)."""
    spec = SpecConfig(method=METHODS[drafter], num_speculative_tokens=2, draft_sample_method=drafting, **options)
    parts = [drafter, drafting, *(verifiers if len(verifiers) == 1 else []), *([tag] if tag else [])]
    return pytest.param(drafter, spec, tuple(verifiers), tuple(samplings), prompt, id="-".join(parts))


LOSSLESS_CASES = [
    # The draft model: both verifiers, greedy and probabilistic drafting, every sampling setting.
    *(lossless_case("draft_model", drafting=drafting, samplings=SAMPLINGS) for drafting in ("greedy", "probabilistic")),
    lossless_case("draft_model", ("block",), samplings=SAMPLINGS[:3:2], tag="pallas", verify_impl="pallas"),
    lossless_case("draft_model", ("block",), tag="float8_cache", kv_cache_dtype="float8_e4m3fn"),
    *(lossless_case(name, ("block",)) for name in ("eagle", "eagle3", "eagle_fr")),
    # EAGLE-2 dynamic trees: each node's top-k (deterministic), recursive rejection sampling ('standard') and
    # traversal verification ('block' on a tree).
    lossless_case("eagle", drafting="greedy", tag="tree5-top2", total_tokens=5, tree_top_k=2),
    *(lossless_case(name, ("standard",), "greedy", samplings, tag="tree5-top2", total_tokens=5, tree_top_k=2)
      for name, samplings in (("eagle3", SAMPLINGS[1:2]), ("eagle_fr", SAMPLINGS[2:3]),
                              ("draft_model", SAMPLINGS[1:2]))),
    lossless_case("medusa"),
    # DFlash: both verifiers, greedy and probabilistic drafting, T 1 and top-k.
    lossless_case("dflash_fr", ("block",)),  # FR-Spec: drafts and their probabilities inside half the ids
    *(lossless_case("dflash", drafting=drafting, samplings=SAMPLINGS[:3:2]) for drafting in ("greedy", "probabilistic")),
    # N-gram lookup drafts one-hot (greedy) from the context.
    lossless_case("ngram", drafting="greedy", prompt=REPEATING_PROMPT, prompt_lookup_min=1, prompt_lookup_max=3),
]


# A lossless case fails below this p-value. With about 45 sampling settings checked, 1e-4 each keeps a false
# alarm anywhere in a run below 0.5% (1e-3 would be 4%: seeds 0..32767 at T 0.7 gave p = 5e-4 for the draft
# model with both verifiers, and 0.33-0.99 with three other seed sets: docs/testing.md); the negative
# controls below fail with p = 1e-124 and below 1e-300 at the same size (support.distributions.NUM_ROWS).
LOSSLESS_ALPHA = 1e-4
GREEDY_ROWS = 64  # greedy rows in each batch: they must give the target's greedy tokens, whatever beside them


@pytest.mark.slow
@pytest.mark.parametrize("drafter, spec, verifiers, samplings, prompt", LOSSLESS_CASES)
def test_speculative_sampling_is_lossless(drafter, spec, verifiers, samplings, prompt):
    """Each sampling setting's rows follow the target's processed distribution exactly (chi-square), in
    batches that mix them with each other and with greedy rows, with each verifier; the verifiers share
    one compiled loop."""
    expected_greedy = generate(tiny_pair()[0], [prompt], max_new_tokens=NUM_TOKENS).tokens[0]
    programs = []
    for verifier in verifiers:
        spec = dataclasses.replace(spec, rejection_sample_method=verifier)
        counts, metrics, greedy_tokens = joint_counts_by_sampling(spec, samplings, tiny_drafter(drafter), prompt,
                                                                  GREEDY_ROWS)
        programs.append(speculative_loop._cache_size())
        assert 0 < metrics.summary()["acceptance_rate"] < 1, verifier  # both paths taken
        assert (greedy_tokens == expected_greedy).all(), verifier
        for sampling, sampling_counts in zip(samplings, counts):
            p_value = chi_square_pvalue(sampling_counts, exact_joint(tiny_pair()[0], sampling, prompt))
            assert p_value > LOSSLESS_ALPHA, (verifier, sampling_id(sampling), p_value)
    assert programs == programs[:1] * len(programs)  # the second verifier compiled nothing


def accept_all(target_probs, draft_tokens, draft_probs, keys):
    """Deliberately wrong: accepts every draft (then samples the bonus token from the target)."""
    n = jnp.full(draft_tokens.shape[:1], draft_tokens.shape[1], jnp.int32)
    return n, standard.verify(target_probs, draft_tokens, draft_probs, keys)[1]


@pytest.mark.slow
def test_negative_control_a_verifier_that_accepts_everything_fails(monkeypatch):
    monkeypatch.setitem(verify_registry.VERIFIERS, "accept_all", verify_registry.Verifier(chain=accept_all,
                                                                                          tree=None))
    spec = SpecConfig(num_speculative_tokens=2, rejection_sample_method="accept_all",
                      draft_sample_method="probabilistic")
    counts, _ = speculative_joint_counts(spec, T1, tiny_drafter("draft_model"))
    assert chi_square_pvalue(counts, exact_joint(tiny_pair()[0], T1)) < 1e-6


@pytest.mark.slow
def test_negative_control_draft_probabilities_not_zero_outside_the_draft_vocabulary_fail(monkeypatch):
    """The same check catches a reduced-vocabulary drafter whose reported q does not match its draws:
    tokens from the draft vocabulary, q half spread over every target id."""
    import specjax.proposers.eagle as eagle_proposer

    draw = eagle_proposer.draw_draft_tokens

    def mislabelled(logits, keys, settings, sampling):
        tokens, probs = draw(logits, keys, settings, sampling)
        return tokens, 0.5 * probs + 0.5 / probs.shape[-1]

    monkeypatch.setattr(eagle_proposer, "draw_draft_tokens", mislabelled)
    jax.clear_caches()  # the loop is traced again with the patch, and that program is not kept for other tests
    try:
        spec = SpecConfig(method="eagle", num_speculative_tokens=2, rejection_sample_method="block",
                          draft_sample_method="probabilistic")
        counts, _ = speculative_joint_counts(spec, T1, tiny_drafter("eagle_fr"))
    finally:
        jax.clear_caches()
    assert chi_square_pvalue(counts, exact_joint(tiny_pair()[0], T1)) < 1e-6


# ------------------------------------------------------------------------------- the cache's edge

@pytest.mark.parametrize("drafter", ["perturbed", "eagle", "eagle3", "medusa", "ngram", "dflash", "dspark", "mtp"])
def test_greedy_output_at_the_edge_of_the_cache_equals_autoregressive(drafter):
    """cache_size exactly prompt + budget + K + 1: the prompt's bucket (32) is then wider than the cache, so the
    prefill pads the prompt only to the cache's width and every drafter's init sees one column fewer than
    positions (the crash of issue 35); a second, shorter row drafts from a different fill level."""
    target = target_and_drafts()[0]
    if drafter == "dflash":  # untrained: lossless whatever it drafts, and no 300-step training
        weights = init_dflash(dflash_config(target.config, (0, 1), block_size=8), seed=1)
    elif drafter == "dspark":
        weights = dspark_drafter(target.config, block_size=8, rank=4)
    elif drafter == "mtp":  # two modules: K 3 runs both, then the last again
        weights = mtp_modules(target.config, 2)
    else:
        weights = greedy_drafter(drafter)
    num_draft, budgets = 3, [6, 4]
    prompts = [[(5 * i + 3) % 100 + 1 for i in range(20)], [9, 8, 7 + 3, 6]]
    cache_size = len(prompts[0]) + budgets[0] + num_draft + 1
    spec = SpecConfig(method=METHODS.get(drafter, drafter), num_speculative_tokens=num_draft,
                      **({"prompt_lookup_min": 1, "prompt_lookup_max": 2} if drafter == "ngram" else {}))
    result = generate(target, prompts, max_new_tokens=budgets, spec=spec, drafter=weights, cache_size=cache_size)
    expected = generate(target, prompts, max_new_tokens=budgets, cache_size=cache_size)
    assert result.sequences() == expected.sequences()
    assert [len(row) for row in result.sequences()] == budgets

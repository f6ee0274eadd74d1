"""Drafter options that apply across drafters: a draft with its own tokenizer (heterogeneous
vocabularies, vLLM's TLI) and the draft KV cache dtype (greedy equality and lossless sampling with a
float8 draft cache: tests/test_lossless.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.models import target_and_drafts

from specjax.config import ConfigError, ModelConfig, SamplingConfig, SpecConfig
from specjax.data.tokenizer import train_bpe_tokenizer
from specjax.decoding import generate
from specjax.models.transformer import init_model
from specjax.proposers import build_proposer, check_spec
from specjax.proposers.base import TargetOutput
from specjax.proposers.heterogeneous import HeterogeneousDraft, intersect_vocabularies, normalize_token

TEXT = ["def add(a, b):\n    return a + b\n", "for item in items:\n    total += item.price\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"] * 30


def tokenizers():
    """Two byte-level BPE tokenizers trained on the same text: different sizes, and the draft's ids
    shifted by extra special tokens, so equal strings have different ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    target = train_bpe_tokenizer(TEXT, vocab_size=300)
    draft = Tokenizer(models.BPE())
    draft.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    draft.decoder = decoders.ByteLevel()
    specials = [f"<extra_{i}>" for i in range(7)]
    draft.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=360, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    return target, draft


@pytest.mark.loop
def test_heterogeneous_vocabularies_greedy_output_is_identical_and_drafts_are_accepted():
    target_tokenizer, draft_tokenizer = tokenizers()
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    mapping = intersect_vocabularies(target_vocab, draft_vocab)
    print(mapping)  # the intersection size, reported
    assert 256 <= mapping.size < min(len(target_vocab), len(draft_vocab)) + 1
    by_id_t = {i: t for t, i in target_vocab.items()}
    by_id_d = {i: t for t, i in draft_vocab.items()}
    pairs = [(t, int(d)) for t, d in enumerate(np.asarray(mapping.target_to_draft)) if d >= 0]
    assert len(pairs) == mapping.size
    assert all(normalize_token(by_id_t[t]) == normalize_token(by_id_d[d]) for t, d in pairs)
    assert sum(t != d for t, d in pairs) > 0.9 * len(pairs)  # the ids really differ

    config = ModelConfig(vocab_size=len(target_vocab), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, intermediate_size=64, init_std=0.3)
    target = init_model(config, seed=0)
    # The draft is the target with its vocabulary rows moved to the draft's ids: on shared tokens it
    # predicts what the target predicts, so a correct mapping shows as long accepted runs.
    draft = init_model(ModelConfig(**{**config.__dict__, "vocab_size": len(draft_vocab)}), seed=1)
    targets, drafts = np.array([t for t, _ in pairs]), np.array([d for _, d in pairs])
    leaves = dict(jax.tree_util.tree_leaves_with_path(target))
    draft = jax.tree_util.tree_map_with_path(lambda path, x: leaves[path] if leaves[path].shape == x.shape else x, draft)
    draft.embed.set_value(draft.embed[...].at[drafts].set(target.embed[...][targets]))
    draft.lm_head.set_value(draft.lm_head[...].at[:, drafts].set(target.lm_head[...][:, targets]))

    prompts = [target_tokenizer.encode(text) for text in ("def add(a, b):", "for item in items:", "class Point:")]
    expected = generate(target, prompts, max_new_tokens=24).sequences()
    spec = SpecConfig(method="draft_model", num_speculative_tokens=4, use_heterogeneous_vocab=True)
    result = generate(target, prompts, max_new_tokens=24, spec=spec, drafter=HeterogeneousDraft(draft, mapping))
    assert result.sequences() == expected
    assert result.metrics.summary()["mean_acceptance_length"] > 2.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(use_heterogeneous_vocab=True, draft_sample_method="probabilistic"),
     r"use_heterogeneous_vocab = True with method 'draft_model' and draft_sample_method 'probabilistic' is "
     r"invalid: allowed only with method 'draft_model' and draft_sample_method 'greedy'"),
    (dict(use_heterogeneous_vocab=True, method="eagle"),
     r"use_heterogeneous_vocab = True with method 'eagle' is invalid: allowed false \(it is an option of method "
     r"'draft_model'\)"),
])
def test_heterogeneous_vocab_is_refused_outside_greedy_draft_models(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        check_spec(SpecConfig(**kwargs))


def test_a_plain_draft_is_refused_under_heterogeneous_vocab():
    target, drafts = target_and_drafts()
    with pytest.raises(ValueError, match=r"use_heterogeneous_vocab needs a HeterogeneousDraft"):
        generate(target, [[1, 2]], max_new_tokens=3, drafter=drafts["perturbed"],
                 spec=SpecConfig(use_heterogeneous_vocab=True))


# --------------------------------------------------------------------------------- draft cache dtype

def draft_cache(kv_cache_dtype):
    target, drafts = target_and_drafts()
    spec = SpecConfig(num_speculative_tokens=3, kv_cache_dtype=kv_cache_dtype)
    proposer = build_proposer(spec, SamplingConfig(), cache_size=64, drafter=drafts["perturbed"])
    prompt = jnp.asarray([[1, 2, 3, 4]])
    _, hidden, _ = target(prompt[:, :3], jnp.arange(3)[None])
    return jax.jit(proposer.init)(drafts["perturbed"], prompt, jnp.asarray([4]), TargetOutput(None, hidden)).cache


def test_a_float8_draft_cache_takes_half_the_memory_of_bfloat16():
    fp8, bf16, inherited = draft_cache("float8_e4m3fn"), draft_cache("bfloat16"), draft_cache(None)
    assert fp8.k.dtype == jnp.float8_e4m3fn and bf16.k.dtype == jnp.bfloat16 and inherited.k.dtype == jnp.float32
    assert fp8.k.nbytes + fp8.v.nbytes == (bf16.k.nbytes + bf16.v.nbytes) // 2


def test_an_unknown_cache_dtype_is_refused():
    with pytest.raises(ConfigError, match=r"SpecConfig.kv_cache_dtype = 'int4' is invalid: allowed \["):
        SpecConfig(kv_cache_dtype="int4")

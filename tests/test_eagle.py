"""EAGLE-1 and EAGLE-3 drafting: drafts that are what the head computes from the committed pairs,
the decoding layout, public checkpoint layouts, and refusals. "eagle_fr" is the EAGLE-1 head with a
reduced draft vocabulary (FR-Spec): drafts only from it. Greedy equality and lossless sampling of
every head: tests/test_lossless.py."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.distributions import TINY
from support.models import FR_IDS, HEADS, METHOD, eagle_config, forward, head_for, target_and_drafts
from support.requests import ragged_requests
from safetensors.numpy import load_file

from specjax.config import SamplingConfig, SpecConfig
from specjax.decoding import generate
from specjax.models import hf
from specjax.models.eagle import (EagleConfig, default_fuse_layers, head_to_decoding_layout, init_eagle, load_eagle,
                                  save_eagle, with_draft_vocabulary)
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import init_model
from specjax.proposers import build_proposer
from specjax.proposers.base import Context, TargetOutput


@pytest.mark.loop
@pytest.mark.parametrize("name", ["eagle", "eagle3", "eagle_fr"])
def test_the_heads_decoding_layout_drafts_the_same(name, tmp_path):
    """head_to_decoding_layout (fused q/k/v and gate/up): the same greedy tokens and acceptance counts as the
    stacked head, and it is not saved as a checkpoint."""
    target, _ = target_and_drafts()
    head = head_for(name)
    split = head_to_decoding_layout(head)
    assert head_to_decoding_layout(split) is split and split.layer.wqkv is not None
    prompts, budgets = ragged_requests()
    spec = SpecConfig(method=METHOD[name], num_speculative_tokens=3)
    want, got = (generate(target, prompts, max_new_tokens=budgets, drafter=h, spec=spec) for h in (head, split))
    assert got.sequences() == want.sequences()
    assert got.metrics.summary() == want.metrics.summary()
    with pytest.raises(ValueError, match=r"decoding layout .* save the head it was made from"):
        save_eagle(split, tmp_path / "out")


@functools.partial(jax.jit, static_argnums=0)
def last_pair_logits(proposer, params, head, tokens, hidden, positions):
    """The proposer's logits at the last pair of one cache-free pass of the head over the pairs (features of
    hidden, tokens), as one program."""
    out, _ = head(tokens, head.fuse(hidden), positions, KVCache.create(head.config.layer, tokens.shape[0], 16),
                  params.embed)
    return proposer.logits(params, out[:, -1])


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_first_draft_is_the_heads_output_on_every_committed_pair(method):
    """The proposer's cache plumbing equals one full (cache-free) pass of the head over the pairs
    (f_j, x_{j+1}), j = 0..L-1, with features from the target's full forward."""
    target, _ = target_and_drafts()
    head = head_for(method)
    prompt = jnp.asarray([[5, 17, 99, 3, 42, 8, 61]])
    first = jnp.asarray([[11]])  # stands for the prefill's token
    sequence = jnp.concatenate([prompt, first], axis=1)
    length = prompt.shape[1]
    spec = SpecConfig(method=method, num_speculative_tokens=3)
    proposer = build_proposer(spec, SamplingConfig(), cache_size=64, drafter=head)
    params = proposer.bind(head, target)
    positions = jnp.arange(length)[None]
    _, hidden, _ = forward(target, prompt, positions, hidden_layers=proposer.hidden_layers)
    lengths = jnp.asarray([length + 1])
    state = jax.jit(proposer.init)(params, sequence, lengths, TargetOutput(logits=None, hidden=hidden))
    drafts, _, _ = jax.jit(proposer.propose)(params, state, Context.of(sequence, lengths),
                                             jax.random.split(jax.random.key(0), 1))

    logits = last_pair_logits(proposer, params, head, sequence[:, 1:], hidden, positions)
    assert int(drafts[0, 0]) == int(jnp.argmax(logits[0]))


@pytest.mark.parametrize("tied", [False, True])
def test_draft_vocabulary_logits_are_the_targets_at_its_ids(tied):
    """An EAGLE-1 head with a draft vocabulary: its logits are the full head's at those ids (the
    target's LM head, or its tied embedding) and -inf at every other id, through a restricted LM head
    that bind gathers once."""
    target = init_model(dataclasses.replace(TINY, tie_word_embeddings=tied), seed=1)
    assert (target.lm_head is None) == tied
    ids = np.array([1, 2, 4, 7])
    full = init_eagle(eagle_config(TINY, version=1), seed=4)
    reduced = with_draft_vocabulary(full, ids)
    proposer = build_proposer(SpecConfig(method="eagle"), SamplingConfig(), cache_size=16, drafter=full)
    features = jax.random.normal(jax.random.key(0), (5, TINY.hidden_size))
    want = np.asarray(proposer.logits(proposer.bind(full, target), features))
    params = proposer.bind(reduced, target)
    assert params.draft_lm_head.shape == (TINY.hidden_size, len(ids))
    got = np.asarray(proposer.logits(params, features))
    np.testing.assert_allclose(got[:, ids], want[:, ids], rtol=1e-6, atol=1e-6)
    assert np.isneginf(np.delete(got, ids, axis=1)).all()


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "sampled"])
def test_an_eagle1_head_with_a_draft_vocabulary_drafts_only_from_it(sampling):
    """Every draft of the FR-Spec head is one of its ids, greedy or sampled (and sampled draft
    probabilities are zero elsewhere); its first greedy draft is the best of those ids under the full
    head's logits, which often prefer an id outside them."""
    target, _ = target_and_drafts()
    full, reduced = head_for("eagle"), head_for("eagle_fr")
    rng = np.random.default_rng(5)
    batch, length = 16, 9
    prompt = jnp.asarray(rng.integers(0, 128, (batch, length)))
    sequence = jnp.concatenate([prompt, jnp.asarray(rng.integers(0, 128, (batch, 1)))], axis=1)
    lengths = jnp.full((batch,), length + 1)
    spec = SpecConfig(method="eagle", num_speculative_tokens=4, draft_sample_method="probabilistic")
    proposer = build_proposer(spec, sampling, cache_size=64, drafter=reduced)
    params = proposer.bind(reduced, target)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    _, hidden, _ = forward(target, prompt, positions)
    state = jax.jit(proposer.init)(params, sequence, lengths, TargetOutput(logits=None, hidden=hidden))
    drafts, probs, _ = jax.jit(proposer.propose)(params, state, Context.of(sequence, lengths, sampling),
                                                 jax.random.split(jax.random.key(1), batch))
    assert np.isin(np.asarray(drafts), FR_IDS).all()
    if probs is not None:
        probs = np.asarray(probs)
        assert probs[..., FR_IDS].sum(-1) == pytest.approx(1.0, abs=1e-5)
        assert (np.delete(probs, FR_IDS, axis=-1) == 0).all()
        return
    full_logits = np.asarray(last_pair_logits(proposer, proposer.bind(full, target), full, sequence[:, 1:], hidden,
                                              positions))
    assert not np.isin(full_logits.argmax(-1), FR_IDS).all()  # the restriction changes some first drafts
    np.testing.assert_array_equal(np.asarray(drafts[:, 0]), FR_IDS[full_logits[:, FR_IDS].argmax(-1)])


@pytest.mark.parametrize("name", ["eagle", "eagle3", "eagle_fr"])
def test_public_checkpoint_layout_round_trips(name, tmp_path):
    """Saved and loaded back with the version read from the weights; a draft vocabulary (d2t and
    draft_vocab_size) survives for either version."""
    target, _ = target_and_drafts()
    head = head_for(name)
    save_eagle(head, tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    if name in ("eagle", "eagle_fr"):
        assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
                "layers.0.post_attention_layernorm.weight"} <= keys
        assert "layers.0.input_layernorm.weight" not in keys  # EAGLE-1 skips it
        raw = json.loads((tmp_path / "config.json").read_text())
        if name == "eagle_fr":
            assert "d2t" in keys and raw["draft_vocab_size"] == len(FR_IDS)
        else:
            assert "d2t" not in keys and "draft_vocab_size" not in raw
    else:
        assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight",
                "lm_head.weight", "d2t"} <= keys
        assert load_file(tmp_path / "model.safetensors")["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    loaded = load_eagle(tmp_path, target.config)  # EAGLE-3's fuse_layers from config.json
    assert loaded.config == head.config and loaded.config.version == HEADS[METHOD[name]]["version"]
    if head.draft_to_target is not None:
        np.testing.assert_array_equal(loaded.draft_to_target[...], head.draft_to_target[...])
    for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_checkpoint_with_a_wrong_shape_names_the_tensor(tmp_path):
    from safetensors.numpy import save_file

    target, _ = target_and_drafts()
    save_eagle(head_for("eagle"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["fc.weight"] = np.zeros((64, 100), np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(hf.CheckpointError, match=r"'fc.weight' has shape \(64, 100\); expected \(64, 128\)"):
        load_eagle(tmp_path, target.config)


def test_a_head_of_another_hidden_size_is_refused():
    target, _ = target_and_drafts()
    layer = dataclasses.replace(target.config, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)
    head = init_eagle(EagleConfig(layer=layer), seed=0)
    with pytest.raises(ValueError, match=r"EAGLE head hidden_size 32 differs from the target's 64"):
        generate(target, [[1, 2, 3]], max_new_tokens=4, spec=SpecConfig(method="eagle"), drafter=head)


def test_an_eagle3_head_for_method_eagle_is_refused():
    target, _ = target_and_drafts()
    with pytest.raises(ValueError, match=r"method 'eagle' needs an EAGLE-1 head, got EAGLE-3"):
        generate(target, [[1, 2, 3]], max_new_tokens=4, spec=SpecConfig(method="eagle"), drafter=head_for("eagle3"))


@pytest.mark.parametrize("ids, message", [
    ([3, 1, 2], r"ids\[1\] = 1 follows ids\[0\] = 3: allowed only sorted ids without repeats"),
    ([1, 2, 2], r"ids\[2\] = 2 follows ids\[1\] = 2: allowed only sorted ids without repeats"),
    ([0, 5, 128], r"ids\[2\] = 128 is outside the target vocabulary: allowed ids in 0..127"),
    ([-1, 5], r"ids\[0\] = -1 is outside the target vocabulary: allowed ids in 0..127"),
    ([[1, 2]], r"ids of shape \(1, 2\) and dtype int64: allowed a non-empty 1-D array of integer token ids"),
    ([0.0, 1.0], r"ids of shape \(2,\) and dtype float64: allowed a non-empty 1-D array of integer token ids"),
    ([], r"ids of shape \(0,\) .* allowed a non-empty 1-D array"),
])
def test_with_draft_vocabulary_refuses_bad_ids(ids, message):
    with pytest.raises(ValueError, match=r"with_draft_vocabulary: " + message):
        with_draft_vocabulary(head_for("eagle"), ids)


def test_with_draft_vocabulary_refuses_an_eagle3_head():
    with pytest.raises(ValueError, match=r"got an EAGLE-3 head, .* allowed only EAGLE-1 heads"):
        with_draft_vocabulary(head_for("eagle3"), FR_IDS)


def test_default_fuse_layers_are_distinct_and_a_head_loads_the_layers_it_records(tmp_path):
    """2, L//2, L-3 where distinct (L >= 7), else 1, L//2, L-1; the bundled head fuses 1, 3, 5, and a head whose
    config.json records a repeated layer (trained before that rule) loads with the layers it records."""
    import shutil

    from specjax import default_models
    from specjax.config import ConfigError
    from specjax.experiments import load_models

    assert {n: default_fuse_layers(n) for n in (4, 6, 7, 32)} == {4: (1, 2, 3), 6: (1, 3, 5), 7: (2, 3, 4),
                                                                 32: (2, 16, 29)}
    assert all(len(set(default_fuse_layers(n))) == 3 for n in range(4, 64))
    with pytest.raises(ConfigError, match=r"default EAGLE-3 fuse layers need a target of >= 4 layers .* got 3"):
        default_fuse_layers(3)
    target, _, head = load_models(default_models.TARGET, "eagle3")
    assert head.config.fuse_layers == (1, 3, 5)
    old = shutil.copytree(default_models.path("eagle3"), tmp_path / "old")
    config = json.loads((old / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 3, 3]
    (old / "config.json").write_text(json.dumps(config))
    assert load_eagle(old, target.config).config.fuse_layers == (2, 3, 3)

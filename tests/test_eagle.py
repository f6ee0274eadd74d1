"""EAGLE-1 and EAGLE-3 drafting: greedy output identical to autoregressive, lossless sampling,
drafts that are what the head computes from the committed pairs, public checkpoint layouts, and
refusals."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import chi_square_pvalue
from safetensors.numpy import load_file
from test_speculative import (TINY, exact_joint, ragged_requests, speculative_joint_counts,
                              target_and_drafts, tiny_pair)

from specjax.config import SamplingConfig, SpecConfig
from specjax.decoding import generate
from specjax.models import hf
from specjax.models.eagle import EagleConfig, init_eagle, load_eagle, save_eagle, split_head
from specjax.models.kv_cache import KVCache
from specjax.proposers import build_proposer
from specjax.proposers.base import Context, TargetOutput


def eagle_config(target_config, version, **kwargs):
    layer = dataclasses.replace(target_config, num_layers=1, init_std=0.1)
    if version == 3:
        kwargs.setdefault("fuse_layers", (0, 1, 2))
    return EagleConfig(layer=layer, version=version, **kwargs)


HEADS = {"eagle": dict(version=1), "eagle3": dict(version=3, draft_vocab_size=100)}


@functools.cache
def head_for(method):
    target, _ = target_and_drafts()
    return init_eagle(eagle_config(target.config, **HEADS[method]), seed=3)


@pytest.mark.parametrize("num_draft", [1, 4])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_output_is_identical_to_autoregressive(method, num_draft):
    from test_speculative import EOS, autoregressive_outputs

    target, _ = target_and_drafts()
    prompts, budgets = ragged_requests()
    result = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS], drafter=head_for(method),
                      spec=SpecConfig(method=method, num_speculative_tokens=num_draft))
    assert result.sequences() == autoregressive_outputs().sequences()


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_the_heads_decoding_layout_drafts_the_same(method, tmp_path):
    """split_head (fused q/k/v and gate/up): the same greedy tokens and acceptance counts as the
    stacked head, and it is not saved as a checkpoint."""
    target, _ = target_and_drafts()
    head = head_for(method)
    split = split_head(head)
    assert split_head(split) is split and split.layer.wqkv is not None
    prompts, budgets = ragged_requests()
    spec = SpecConfig(method=method, num_speculative_tokens=3)
    want, got = (generate(target, prompts, max_new_tokens=budgets, drafter=h, spec=spec) for h in (head, split))
    assert got.sequences() == want.sequences()
    assert got.metrics.summary() == want.metrics.summary()
    with pytest.raises(ValueError, match=r"decoding layout .* save the head it was made from"):
        save_eagle(split, tmp_path / "out")


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
    _, hidden, _ = target(prompt, positions, hidden_layers=proposer.hidden_layers)
    state = proposer.init(params, sequence, jnp.asarray([length + 1]), TargetOutput(logits=None, hidden=hidden))
    drafts, _, _ = proposer.propose(params, state, Context(tokens=sequence, lengths=jnp.asarray([length + 1])),
                                    jax.random.split(jax.random.key(0), 1))

    features = head.fuse(hidden)
    out, _ = head(sequence[:, 1:], features, positions, KVCache.create(head.config.layer, 1, 16), params.embed)
    logits = proposer._logits(params, out[:, -1])
    assert int(drafts[0, 0]) == int(jnp.argmax(logits[0]))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_sampling_with_eagle_is_lossless(method):
    target, _ = tiny_pair()
    kwargs = dict(HEADS[method])
    if method == "eagle3":
        kwargs["draft_vocab_size"] = 6  # a reduced draft vocabulary: two target ids never drafted
        kwargs["fuse_layers"] = (0, 1, 1)  # the tiny target has one layer
    head = init_eagle(eagle_config(TINY, **kwargs), seed=4)
    sampling = SamplingConfig(temperature=1.0)
    spec = SpecConfig(method=method, num_speculative_tokens=2, rejection_sample_method="block",
                      draft_sample_method="probabilistic")
    counts, metrics = speculative_joint_counts(spec, sampling, drafter=head)
    assert 0 < metrics.summary()["acceptance_rate"] < 1
    assert chi_square_pvalue(counts, exact_joint(target, sampling)) > 1e-3


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_public_checkpoint_layout_round_trips(method, tmp_path):
    target, _ = target_and_drafts()
    head = head_for(method)
    save_eagle(head, tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    if method == "eagle":
        assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
                "layers.0.post_attention_layernorm.weight"} <= keys
        assert "layers.0.input_layernorm.weight" not in keys  # EAGLE-1 skips it
    else:
        assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight",
                "lm_head.weight", "d2t"} <= keys
        assert load_file(tmp_path / "model.safetensors")["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    loaded = load_eagle(tmp_path, target.config, fuse_layers=head.config.fuse_layers or None)
    assert loaded.config == head.config
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
    with pytest.raises(ValueError, match=r"EAGLE head hidden_size 32 does not match the target's 64"):
        generate(target, [[1, 2, 3]], max_new_tokens=4, spec=SpecConfig(method="eagle"), drafter=head)


def test_an_eagle3_head_for_method_eagle_is_refused():
    target, _ = target_and_drafts()
    with pytest.raises(ValueError, match=r"method 'eagle' needs an EAGLE-1 head, got EAGLE-3"):
        generate(target, [[1, 2, 3]], max_new_tokens=4, spec=SpecConfig(method="eagle"), drafter=head_for("eagle3"))

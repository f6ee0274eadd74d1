"""DFlash: z-lab's layout against z-lab's own model code (golden files from scripts/make_dflash_fixtures.py:
a tiny Qwen3 target and DFlash drafter, their first-block and in-generation draft logits and greedy
output), the drafter's own checkpoint round trip and errors, the proposer's cache against a forward from
scratch, and training (loss falls, a stopped run resumes exactly, a corrupt checkpoint is refused).
Greedy equality and losslessness for DFlash are in test_lossless.py with every other drafter."""

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import FIXTURES, REPO
from support.models import forward
from safetensors.numpy import load_file, save_file

from specjax.config import DFlashTrainConfig, SamplingConfig, SpecConfig, load_yaml
from specjax.decoding import generate
from specjax.models import hf
from specjax.models.dflash import (default_target_layer_ids, drafter_to_decoding_layout, load_dflash, save_dflash,
                                   with_draft_vocabulary)
from specjax.models.transformer import unembed
from specjax.proposers import Context, TargetOutput, UnsupportedSpeculation, build_proposer, check_spec

T1 = SamplingConfig(temperature=1.0)

TARGET, DRAFTER = FIXTURES / "dflash" / "target", FIXTURES / "dflash" / "drafter"


@pytest.fixture(scope="module")
def zlab():
    target = hf.load(TARGET)
    return target, load_dflash(DRAFTER, target.config), dict(np.load(FIXTURES / "golden" / "dflash.npz"))


def block_logits(target, drafter, committed: list[int], block_size: int | None = None, pad_to: int | None = None):
    """Draft logits of the block anchored at committed[-1] (block_size tokens, by default the drafter's:
    the block's tokens see one another, so its size matters), from a forward from scratch: the context
    features of committed[:-1] written to an empty cache, then the block. pad_to: the context padded to
    that many tokens and the cache cut back to the real ones (the target is causal), so that calls for
    different lengths share their program."""
    context_len = len(committed) - 1
    width = pad_to or context_len
    tokens = jnp.asarray([committed[:-1] + [0] * (width - context_len)])
    return np.asarray(block_forward(target, drafter, tokens, jnp.asarray(context_len), jnp.asarray(committed[-1]),
                                    block_size=block_size or drafter.config.block_size))


@functools.partial(jax.jit, static_argnames="block_size")
def block_forward(target, drafter, tokens, context_len, anchor, *, block_size: int):
    """block_logits' forward as one program (eagerly, each of its operations compiles apart)."""
    config = drafter.config
    positions = jnp.arange(tokens.shape[1])[None]
    _, hidden, _ = target(tokens, positions, hidden_layers=config.hidden_layers)
    cache = drafter.write_context(drafter.context(hidden), positions,
                                  drafter.create_cache(1, tokens.shape[1] + 1 + block_size))
    cache = cache.with_lengths(context_len[None])
    block = jnp.concatenate([anchor[None], jnp.full(block_size - 1, config.mask_token_id)])[None]
    out, _ = drafter(block, context_len + jnp.arange(block_size)[None], cache, target.embed[...])
    return unembed(out[0, 1:], target.embed[...], target.lm_head[...], target.config.jnp_dtype)


def test_the_first_block_gives_zlabs_draft_logits(zlab):
    target, drafter, golden = zlab
    assert drafter.config.target_layer_ids == (0, 2) and drafter.config.block_size == 8
    committed = golden["prompt"].tolist() + [int(golden["first_token"])]
    np.testing.assert_allclose(block_logits(target, drafter, committed), golden["first_block_logits"], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_every_block_of_zlabs_generation_gives_its_draft_logits(zlab):
    """The blocks z-lab's dflash_generate drafted (after verify steps, on its cropped draft cache), each
    anchored where its acceptance left it, from the greedy output's committed tokens."""
    target, drafter, golden = zlab
    prompt, greedy = golden["prompt"].tolist(), golden["greedy"].tolist()
    emitted = 0
    for logits in golden["block_logits"]:
        committed = prompt + greedy[:emitted + 1]
        np.testing.assert_allclose(block_logits(target, drafter, committed, pad_to=len(prompt) + len(greedy)), logits,
                                   atol=1e-4, rtol=0)
        drafts = logits.argmax(-1).tolist()
        accepted = next((i for i, d in enumerate(drafts) if d != greedy[emitted + 1 + i]), len(drafts)) \
            if emitted + 1 + len(drafts) <= len(greedy) else 0
        emitted += accepted + 1
        if emitted >= len(greedy) - 1:
            break


@pytest.mark.loop
def test_greedy_speculative_output_is_zlabs(zlab):
    target, drafter, golden = zlab
    spec = SpecConfig(method="dflash", num_speculative_tokens=7)
    result = generate(target, [golden["prompt"].tolist()], max_new_tokens=len(golden["greedy"]), spec=spec,
                      drafter=drafter)
    assert result.sequences()[0] == golden["greedy"].tolist()


def test_the_full_block_is_drafted_by_default_where_k_plus_1_is_shorter(zlab):
    """dflash_full_block None (auto): the whole block where K + 1 < block_size; True / False force it."""
    _, drafter, _ = zlab
    block = drafter.config.block_size
    masks = {(k, full): build_proposer(SpecConfig(method="dflash", num_speculative_tokens=k, dflash_full_block=full),
                                       SamplingConfig(), 64, drafter).num_masks(drafter)
             for k in (3, block - 1) for full in (None, True, False)}
    assert masks == {(3, None): block - 1, (3, True): block - 1, (3, False): 3,
                     (block - 1, None): block - 1, (block - 1, True): block - 1, (block - 1, False): block - 1}
    assert SpecConfig(method="eagle").dflash_full_block is None


@pytest.mark.parametrize("full_block", [pytest.param(False, marks=pytest.mark.slow), True],  # the default: fast tier
                         ids=["K_masks", "full_block"])
def test_the_proposers_cache_holds_what_a_forward_from_scratch_computes(zlab, full_block):
    """Draft probabilities inside the loop's bookkeeping (prefill, propose, accept n, propose) equal the
    ones of a drafter forward from scratch over the same committed tokens, in both layouts: those of a
    block of K + 1, or with dflash_full_block the first K slots of the drafter's whole block."""
    target, stacked, golden = zlab
    prompt = golden["prompt"].tolist()
    block_size = stacked.config.block_size if full_block else 5
    assert stacked.config.block_size > 5  # so that the full block differs from K + 1
    for drafter in (stacked, drafter_to_decoding_layout(stacked)):
        spec = SpecConfig(method="dflash", num_speculative_tokens=4, draft_sample_method="probabilistic",
                          dflash_full_block=full_block)
        proposer = build_proposer(spec, SamplingConfig(temperature=1.0), 64, drafter)
        params = proposer.bind(drafter, target)
        init, propose, accept = (jax.jit(f) for f in (proposer.init, proposer.propose, proposer.accept))
        positions = jnp.arange(len(prompt))[None]
        cache = target.create_cache(1, 64)
        logits, hidden, cache = forward(target, jnp.asarray([prompt]), positions, cache,
                                        hidden_layers=proposer.hidden_layers)
        committed = prompt + [int(jnp.argmax(logits[0, -1]))]
        state = init(params, jnp.asarray([committed]), jnp.asarray([len(committed)]),
                     TargetOutput(logits=logits, hidden=hidden))
        for num_accepted in (2, 0, 4):
            padded = jnp.asarray([committed + [0] * (len(prompt) + 24 - len(committed))])  # one shape: one program
            drafts, probs, state = propose(params, state, Context.of(padded, jnp.asarray([len(committed)]), T1),
                                           jax.random.split(jax.random.key(0), 1))
            expected = jax.nn.softmax(block_logits(target, stacked, committed, block_size=block_size,
                                                   pad_to=len(prompt) + 16)[:4], -1)
            np.testing.assert_allclose(np.asarray(probs[0]), expected, atol=1e-5, rtol=0)
            block = [committed[-1]] + np.asarray(drafts[0]).tolist()
            start = len(committed) - 1
            logits, hidden, cache = forward(target, jnp.asarray([block]), start + jnp.arange(5)[None],
                                            cache.with_lengths(jnp.asarray([start])),
                                            hidden_layers=proposer.hidden_layers)
            next_token = int(jnp.argmax(logits[0, num_accepted]))
            committed = committed + block[1:num_accepted + 1] + [next_token]
            state = accept(state, jnp.asarray([num_accepted]), jnp.asarray([next_token]),
                           TargetOutput(logits=logits, hidden=hidden))


def test_a_propose_told_the_verified_width_drafts_those_drafts_alike_and_zeros_past_them(zlab):
    """Context.verified (adaptive verification's width, chosen before drafting): the LM head runs over the first W
    drafts only; they and their probabilities are those of the propose of all K, and the rest are zeros."""
    target, drafter, golden = zlab
    prompt = golden["prompt"].tolist()
    spec = SpecConfig(method="dflash", num_speculative_tokens=4, draft_sample_method="probabilistic",
                      enable_adaptive_verification=True)
    proposer = build_proposer(spec, T1, 64, drafter)
    params = proposer.bind(drafter, target)
    logits, hidden, _ = forward(target, jnp.asarray([prompt]), jnp.arange(len(prompt))[None], target.create_cache(1, 64),
                                hidden_layers=proposer.hidden_layers)
    state = proposer.init(params, jnp.asarray([prompt]), jnp.asarray([len(prompt)]), TargetOutput(logits, hidden))
    propose = jax.jit(proposer.propose)
    keys = jax.random.split(jax.random.key(3), 1)
    tokens, lengths = jnp.asarray([prompt + [0] * 16]), jnp.asarray([len(prompt)])
    every, every_probs, every_state = propose(params, state, Context.of(tokens, lengths, T1), keys)
    assert proposer.drafts_to_width and spec.verify_widths == (0, 1, 2, 3, 4)
    for width in (1, 2, 3, 4):
        context = dataclasses.replace(Context.of(tokens, lengths, T1), verified=width)
        drafts, probs, after = propose(params, state, context, keys)
        np.testing.assert_array_equal(drafts[:, :width], every[:, :width])
        np.testing.assert_allclose(probs[:, :width], every_probs[:, :width], atol=1e-6, rtol=0)
        assert not np.asarray(drafts[:, width:]).any() and not np.asarray(probs[:, width:]).any()
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), after, every_state))


def test_save_writes_the_tensors_zlab_wrote(zlab, tmp_path):
    _, drafter, _ = zlab
    save_dflash(drafter, tmp_path)
    original, exported = load_file(DRAFTER / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert exported.keys() == original.keys()
    for key in original:
        np.testing.assert_array_equal(exported[key], original[key], err_msg=key)
    assert load_dflash(tmp_path).config == drafter.config
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["dflash_config"]["target_layer_ids"] == [0, 2] and raw["architectures"] == ["DFlashDraftModel"]


def test_a_misshaped_tensor_is_named(tmp_path):
    folder = tmp_path / "drafter"
    shutil.copytree(DRAFTER, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["fc.weight"] = tensors["fc.weight"][:, :64]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(hf.CheckpointError, match=r"tensor 'fc.weight' has shape \(64, 64\); expected \(64, 128\)"):
        load_dflash(folder)


def test_bad_drafters_and_settings_are_refused(zlab, tmp_path):
    target, drafter, golden = zlab
    with pytest.raises(UnsupportedSpeculation, match=r"num_speculative_tokens = 8 .*allowed 1..7"):
        generate(target, [[3, 4]], max_new_tokens=4, spec=SpecConfig(method="dflash", num_speculative_tokens=8),
                 drafter=drafter)
    with pytest.raises(ValueError, match=r"SpecConfig.dflash_full_block = True with method 'eagle' is invalid: allowed "
                                         r"null or false \(it is an option of method 'dflash' or 'dspark'\)"):
        check_spec(SpecConfig(method="eagle", dflash_full_block=True))
    with pytest.raises(ValueError, match=r"SpecConfig.dflash_full_block = 1 is invalid: allowed null \(auto\), true or "):
        check_spec(SpecConfig(method="dflash", dflash_full_block=1))
    with pytest.raises(ValueError, match=r"DFlashConfig.target_layer_ids = \(0, 4\) is invalid: allowed layers 0..3"):
        dataclasses.replace(drafter.config, target_layer_ids=(0, 4))
    with pytest.raises(ValueError, match=r"DFlashConfig.mask_token_id = 128 is invalid"):
        dataclasses.replace(drafter.config, mask_token_id=128)
    folder = tmp_path / "drafter"
    shutil.copytree(DRAFTER, folder)
    raw = json.loads((folder / "config.json").read_text())
    del raw["dflash_config"]["mask_token_id"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(hf.CheckpointError, match=r"field dflash_config.mask_token_id is missing"):
        load_dflash(folder)


def test_default_target_layers_are_zlabs_choice():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B-DFlash-b16's
    assert default_target_layer_ids(24, 1) == (12,)
    assert default_target_layer_ids(64, 4)[::3] == (1, 61)


# ------------------------------------------------------------------------------------------ training

DFLASH_CONFIG = REPO / "configs/train/tiny_dflash.yaml"


def dflash_run_config(target_dir, output_dir, *overrides) -> DFlashTrainConfig:
    return load_yaml(DFlashTrainConfig, DFLASH_CONFIG, [f"target={target_dir}", f"output_dir={output_dir}", *overrides])


def test_a_draft_vocabulary_keeps_drafts_and_their_probabilities_inside_it_and_is_not_saved(zlab, tmp_path):
    """FR-Spec for DFlash: the draft probabilities are the full drafter's renormalised over the draft ids, zero
    elsewhere, so every draft is one of them; such a drafter is applied at run time, not saved."""
    target, stacked, golden = zlab
    ids = np.arange(0, target.config.vocab_size, 3)
    reduced = with_draft_vocabulary(stacked, ids)
    prompt = golden["prompt"].tolist()
    probs = {}
    for name, drafter in (("full", stacked), ("reduced", reduced)):
        proposer = build_proposer(SpecConfig(method="dflash", num_speculative_tokens=4,
                                             draft_sample_method="probabilistic"), SamplingConfig(temperature=1.0),
                                  64, drafter)
        params = proposer.bind(drafter, target)
        logits, hidden, _ = target(jnp.asarray([prompt]), jnp.arange(len(prompt))[None],
                                   hidden_layers=proposer.hidden_layers)
        committed = jnp.asarray([prompt + [int(jnp.argmax(logits[0, -1]))]])
        lengths = jnp.asarray([committed.shape[1]])
        state = jax.jit(proposer.init)(params, committed, lengths, TargetOutput(logits=logits, hidden=hidden))
        drafts, probs[name], _ = jax.jit(proposer.propose)(params, state, Context.of(committed, lengths, T1),
                                                           jax.random.split(jax.random.key(0), 1))
    assert set(np.asarray(drafts).ravel().tolist()) <= set(ids.tolist())
    outside = np.setdiff1d(np.arange(target.config.vocab_size), ids)
    assert (np.asarray(probs["reduced"])[..., outside] == 0).all()
    inside = np.asarray(probs["full"])[..., ids]
    np.testing.assert_allclose(np.asarray(probs["reduced"])[..., ids], inside / inside.sum(-1, keepdims=True),
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="draft vocabulary .* apply the vocabulary at run time"):
        save_dflash(reduced, tmp_path)

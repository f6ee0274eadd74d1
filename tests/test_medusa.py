"""Medusa heads: the feature each draft reads, a shared LM head, checkpoints in the public Medusa
layout, and refusals. Greedy equality and lossless sampling: tests/test_lossless.py."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import fixture_dir
from support.models import forward, medusa_for, positions_like
from safetensors.numpy import save_file

from specjax.config import SamplingConfig, SpecConfig
from specjax.decoding import generate
from specjax.models import hf
from specjax.models.hf import CheckpointError
from specjax.models.medusa import LMHead, MedusaConfig, init_medusa, load_medusa, save_medusa
from specjax.models.transformer import Hidden
from specjax.proposers import TargetOutput, build_proposer
from specjax.proposers.base import Context


@functools.cache
def target():
    return hf.load(fixture_dir("llama_gqa"))


# ------------------------------------------------------------------------------------------- drafts

@pytest.mark.parametrize("shared", [False, True], ids=["own_projection", "shared_lm_head"])
def test_drafts_read_the_feature_that_drew_the_newest_token(shared):
    """Zero blocks leave each head the target's LM head, so every draft must be the token that h_t drew:
    the newest committed one. Any other position's feature would draw another token."""
    model, num_draft = target(), 3
    proposer = build_proposer(SpecConfig(method="medusa", num_speculative_tokens=num_draft), SamplingConfig(), 64)
    bound = proposer.bind(medusa_for(model, num_draft, shared=shared), model)
    prompts = jnp.asarray(np.random.default_rng(1).integers(0, 128, (3, 6)), jnp.int32)
    lengths = jnp.array([6, 4, 2], jnp.int32)  # ragged prompts, right-padded
    logits, hidden, _ = forward(model, prompts, positions_like(prompts))
    rows = jnp.arange(3)
    first = jnp.argmax(logits[rows, lengths - 1], axis=-1).astype(jnp.int32)
    assert (jnp.argmax(logits[rows, lengths - 2], axis=-1) != first).any()  # a neighbour's feature would show
    committed = jnp.concatenate([prompts, jnp.zeros((3, 1), jnp.int32)], axis=1).at[rows, lengths].set(first)
    state = jax.jit(proposer.init)(bound, committed, lengths + 1, TargetOutput(logits=None, hidden=hidden))
    context = Context.of(committed, lengths + 1)
    drafts, probs, state = jax.jit(proposer.propose)(bound, state, context, jax.random.split(jax.random.key(0), 3))
    assert probs is None
    np.testing.assert_array_equal(drafts, jnp.repeat(first[:, None], num_draft, axis=1))

    # A verify forward over [first, d_1 .. d_K] after each padded prompt; rows keep 0, 1 and K drafts.
    # (Padding inside a row changes its hidden states, not which position accept must read.)
    verify = jnp.concatenate([prompts, first[:, None], drafts], axis=1)
    logits, hidden, _ = forward(model, verify, positions_like(verify))
    num_accepted = jnp.array([0, 1, num_draft], jnp.int32)
    next_token = jnp.argmax(logits[rows, prompts.shape[1] + num_accepted], axis=-1).astype(jnp.int32)
    verify_hidden = Hidden(final=hidden.final[:, prompts.shape[1]:], layers=None)
    state = jax.jit(proposer.accept)(state, num_accepted, next_token, TargetOutput(logits=None, hidden=verify_hidden))
    drafts, _, _ = jax.jit(proposer.propose)(bound, state, context, jax.random.split(jax.random.key(1), 3))
    np.testing.assert_array_equal(drafts, jnp.repeat(next_token[:, None], num_draft, axis=1))


@pytest.mark.parametrize("fixture", ["llama_gqa", "llama_mha_tied"])
def test_shared_lm_head_equals_a_copied_one(fixture):
    model = hf.load(fixture_dir(fixture))
    own, shared = medusa_for(model, 2, scale=0.3), medusa_for(model, 2, scale=0.3, shared=True)
    hidden = jax.random.normal(jax.random.key(2), (4, model.config.hidden_size))
    np.testing.assert_allclose(own(hidden), shared(hidden, LMHead.of(model)), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- checkpoints

def test_save_load_round_trip(tmp_path):
    heads = medusa_for(target(), num_heads=3, num_layers=2, scale=0.1)
    save_medusa(heads, tmp_path, base_model_name_or_path="llama_gqa")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {"medusa_num_heads": 3, "medusa_num_layers": 2, "hidden_size": 64, "vocab_size": 128,
                      "base_model_name_or_path": "llama_gqa"}
    loaded = load_medusa(tmp_path)
    assert loaded.config == heads.config
    for name in ("block_w", "block_b", "lm_head"):
        np.testing.assert_array_equal(getattr(loaded, name)[...], getattr(heads, name)[...])


def test_heads_sharing_the_lm_head_store_no_projection(tmp_path):
    """The extension of the layout for shared heads: no per-head projections, a flag in config.json."""
    from safetensors.numpy import load_file

    heads = medusa_for(target(), num_heads=3, num_layers=1, scale=0.1, shared=True)
    save_medusa(heads, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["shared_lm_head"] is True
    stored = load_file(tmp_path / "medusa_lm_head.safetensors")
    assert not [key for key in stored if key.endswith(".1.weight")] and len(stored) == 6
    loaded = load_medusa(tmp_path)
    assert loaded.config == heads.config and loaded.lm_head is None
    hidden = jax.random.normal(jax.random.key(0), (2, 64))
    np.testing.assert_array_equal(loaded(hidden, LMHead.of(target())), heads(hidden, LMHead.of(target())))


HIDDEN, VOCAB, NUM_HEADS, NUM_LAYERS = 8, 12, 2, 2


def public_tensors() -> dict[str, np.ndarray]:
    """Tiny heads in the FasterDecoding/Medusa state-dict layout (torch Linear weights are [out, in])."""
    rng = np.random.default_rng(3)
    tensors = {}
    for k in range(NUM_HEADS):
        for j in range(NUM_LAYERS):
            tensors[f"{k}.{j}.linear.weight"] = rng.normal(0, 0.3, (HIDDEN, HIDDEN)).astype(np.float32)
            tensors[f"{k}.{j}.linear.bias"] = rng.normal(0, 0.3, HIDDEN).astype(np.float32)
        tensors[f"{k}.{NUM_LAYERS}.weight"] = rng.normal(0, 0.3, (VOCAB, HIDDEN)).astype(np.float32)
    return tensors


def write_public_checkpoint(folder, tensors):
    # The original config.json names only the head counts (and the base model).
    (folder / "config.json").write_text(json.dumps(
        {"medusa_num_heads": NUM_HEADS, "medusa_num_layers": NUM_LAYERS, "base_model_name_or_path": "m"}))
    save_file(tensors, folder / "medusa_lm_head.safetensors")


def torch_style_forward(tensors, hidden: np.ndarray) -> np.ndarray:
    """What the original nn.Sequential(ResBlock * L, Linear(D, V, bias=False)) computes, head by head."""
    def silu(x):
        return x / (1 + np.exp(-x))

    out = []
    for k in range(NUM_HEADS):
        x = hidden
        for j in range(NUM_LAYERS):
            x = x + silu(x @ tensors[f"{k}.{j}.linear.weight"].T + tensors[f"{k}.{j}.linear.bias"])
        out.append(x @ tensors[f"{k}.{NUM_LAYERS}.weight"].T)
    return np.stack(out, axis=1)


def test_a_public_layout_checkpoint_loads_and_computes_the_original_heads(tmp_path):
    tensors = public_tensors()
    write_public_checkpoint(tmp_path, tensors)
    heads = load_medusa(tmp_path)
    assert heads.config == MedusaConfig(num_heads=NUM_HEADS, num_layers=NUM_LAYERS, hidden_size=HIDDEN,
                                        vocab_size=VOCAB)
    hidden = np.random.default_rng(4).normal(size=(5, HIDDEN)).astype(np.float32)
    np.testing.assert_allclose(heads(jnp.asarray(hidden)), torch_style_forward(tensors, hidden),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("heads, num_draft, message", [
    (lambda: init_medusa(MedusaConfig(num_heads=4, hidden_size=32, vocab_size=128)), 2,
     r"Medusa hidden_size 32 differs from the target's 64"),
    (lambda: medusa_for(target(), num_heads=3), 4,
     r"Medusa has 3 heads but num_speculative_tokens is 4: allowed K <= 3"),
], ids=["hidden_size", "too_few_heads"])
def test_unusable_heads_are_refused(heads, num_draft, message):
    with pytest.raises(ValueError, match=message):
        generate(target(), [[1, 2]], max_new_tokens=4, drafter=heads(),
                 spec=SpecConfig(method="medusa", num_speculative_tokens=num_draft))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("1.0.linear.bias"), r"tensor '1.0.linear.bias' is missing \(medusa_num_heads=2, "),
    (lambda t: t.update({"0.1.linear.weight": np.zeros((HIDDEN, HIDDEN + 1), np.float32)}),
     r"tensor '0.1.linear.weight' has shape \(8, 9\); expected \(8, 8\) for hidden_size=8, vocab_size=12"),
    (lambda t: t.update({"2.0.linear.weight": np.zeros((HIDDEN, HIDDEN), np.float32)}),
     r"tensors not used by 2 heads of 2 blocks: \['2.0.linear.weight'\]"),
], ids=["missing", "mis_shaped", "unexpected"])
def test_bad_checkpoints_are_refused(tmp_path, edit, message):
    tensors = public_tensors()
    edit(tensors)
    write_public_checkpoint(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=message):
        load_medusa(tmp_path)


def test_a_torch_only_checkpoint_is_refused_with_a_conversion_hint(tmp_path):
    write_public_checkpoint(tmp_path, public_tensors())
    (tmp_path / "medusa_lm_head.safetensors").rename(tmp_path / "medusa_lm_head.pt")
    with pytest.raises(CheckpointError, match=r"no medusa_lm_head.safetensors found; only medusa_lm_head.pt"):
        load_medusa(tmp_path)

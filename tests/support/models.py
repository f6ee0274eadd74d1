"""The models the tests decode with: the fixture target and its draft models, EAGLE heads, Medusa heads
and DFlash drafters for it (the trained DFlash drafter is a committed fixture), and `forward`, a model
call as one program."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.models import hf
from specjax.models.dflash import DFlashConfig, DFlashDrafter, load_dflash
from specjax.models.eagle import EagleConfig, init_eagle, with_draft_vocabulary
from specjax.models.dspark import dspark_config, init_dspark, with_random_heads
from specjax.models.medusa import MedusaConfig, init_medusa
from specjax.models.mtp import MTPConfig, init_mtp

from support.checkpoints import TRAINED_DFLASH, fixture_dir
from support.distributions import TINY

EOS = 7


@functools.partial(jax.jit, static_argnames=("hidden_layers", "compute_logits", "causal"))
def forward(model, tokens, positions, cache=None, *, hidden_layers=(), compute_logits=True, causal=True,
            attention_mask=None):
    """model(tokens, positions, cache, ...) as one program: called eagerly, a model compiles one program per
    operation and shape, which made the model-level tests' time mostly compiling (docs/testing.md)."""
    return model(tokens, positions, cache, hidden_layers=hidden_layers, compute_logits=compute_logits,
                 causal=causal, attention_mask=attention_mask)


def assert_float32_close(actual, desired, err_msg: str = "") -> None:
    """actual equals desired up to float32 rounding of differently ordered sums: within 1e-5 of desired's
    largest magnitude (~80 float32 ulps of it). The rounding differs by CPU (XLA's kernels block a product by
    the vector width): an absolute 1e-5 on logits of ~5 failed on CI's machine at 1.3e-5 and passed here at
    6e-6. A wrong cache or mask is off by O(1)."""
    desired = np.asarray(desired, np.float32)
    np.testing.assert_allclose(np.asarray(actual), desired, rtol=0, atol=1e-5 * max(1.0, float(np.abs(desired).max())),
                               err_msg=err_msg)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def initialised(init, config, seed: int):
    """init(config, seed) as one program, the same weights bit for bit: eagerly each weight's initialiser
    compiles apart (tens of programs a drafter)."""
    return init(config, seed)


def positions_like(tokens) -> jnp.ndarray:
    """Positions 0..T-1 for every row of a [B, T] token array."""
    batch, length = tokens.shape
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def perturbed(model, scale: float, seed: int = 0):
    """The model with Gaussian noise on every weight: a draft that agrees with it often, not always."""
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@functools.cache
def target_and_drafts():
    """The llama_gqa fixture and two draft models for it: "perturbed" (close) and "unrelated"."""
    target = hf.load(fixture_dir("llama_gqa"))
    return target, {"perturbed": perturbed(target, 0.01), "unrelated": hf.load(fixture_dir("llama_mha_tied"))}


def dflash_config(target_config: ModelConfig, target_layer_ids: tuple[int, ...], block_size: int,
                  **layer_changes) -> DFlashConfig:
    """A DFlash drafter's shape for a target: one Qwen3 layer as wide as the target's (layer_changes
    change it), the target's last id as mask."""
    layer = dataclasses.replace(target_config, num_layers=1, qk_norm=True, architecture="Qwen3ForCausalLM",
                                **layer_changes)
    return DFlashConfig(layer=layer, target_layer_ids=target_layer_ids, mask_token_id=target_config.vocab_size - 1,
                        block_size=block_size, num_target_layers=target_config.num_layers)


@functools.cache
def trained_dflash() -> DFlashDrafter:
    """A DFlash drafter (block 16, reading both layers) for target_and_drafts()'s target, trained for
    300 steps on the target's greedy continuations of random prompts, distilling its distribution
    (scripts/make_test_fixtures.py). The target is random, so little of that generalises: its drafts are
    accepted now and then (a mean acceptance length of about 1.03 at K 8), enough for greedy tests to
    verify accepted drafts."""
    return load_dflash(TRAINED_DFLASH, target_and_drafts()[0].config)


def eagle_config(target_config, version, **kwargs):
    layer = dataclasses.replace(target_config, num_layers=1, init_std=0.1)
    if version == 3:
        kwargs.setdefault("fuse_layers", (0, 1, 2))
    return EagleConfig(layer=layer, version=version, **kwargs)


HEADS = {"eagle": dict(version=1), "eagle3": dict(version=3, draft_vocab_size=100)}
# FR-Spec: the "eagle" head drafting from half the target's 128 ids; the target's greedy output has
# tokens outside them too (checked in the greedy test).
FR_IDS = np.arange(0, 128, 2)
METHOD = {"eagle": "eagle", "eagle3": "eagle3", "eagle_fr": "eagle"}  # head name -> SpecConfig.method


@functools.cache
def head_for(name):
    """An EAGLE head for target_and_drafts()'s target: "eagle", "eagle3" or "eagle_fr"."""
    if name == "eagle_fr":
        return with_draft_vocabulary(head_for("eagle"), FR_IDS)
    target, _ = target_and_drafts()
    return initialised(init_eagle, eagle_config(target.config, **HEADS[name]), 3)


def with_random_blocks(heads, scale: float, seed: int = 0):
    """The heads with Gaussian residual blocks: zero blocks plus the copied LM head make every head
    repeat the target's next token; random ones make the heads disagree."""
    w_key, b_key = jax.random.split(jax.random.key(seed))
    heads.block_w.set_value(scale * jax.random.normal(w_key, heads.block_w.shape))
    heads.block_b.set_value(scale * jax.random.normal(b_key, heads.block_b.shape))
    return heads


def medusa_for(model, num_heads: int, num_layers: int = 1, scale: float = 0.0, shared: bool = False):
    config = MedusaConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=model.config.hidden_size,
                          vocab_size=model.config.vocab_size, shared_lm_head=shared)
    return with_random_blocks(init_medusa(config, model), scale)



def dspark_drafter(target_config, block_size: int, rank: int, sample_from_anchor: bool = True, scale: float = 0.5,
                   layer_ids=(0, 1), seed: int = 3, head: str = "vanilla"):
    """An untrained DSpark drafter with random (not zero) Markov and confidence weights."""
    config = dspark_config(dflash_config(target_config, layer_ids, block_size=block_size), markov_rank=rank,
                           sample_from_anchor=sample_from_anchor, markov_head_type=head)
    return with_random_heads(initialised(init_dspark, config, seed), scale, seed=seed)


def mtp_modules(target_config, num_modules: int, init_std: float = 0.3, seed: int = 0, **options):
    """Random MTP modules with Qwen2 layers as wide as the target's (options: MTPConfig's)."""
    layer = dataclasses.replace(target_config, num_layers=num_modules, architecture="Qwen2ForCausalLM", qkv_bias=True,
                                qk_norm=False, out_bias=False, init_std=init_std)
    return initialised(init_mtp, MTPConfig(layer=layer, **options), seed)


@functools.cache
def tiny_mtp_modules():
    """Two random modules for the tiny pair's target (support.distributions.TINY), wide enough apart (init 0.6)
    that the chi-square cases see drafts accepted and rejected."""
    return mtp_modules(TINY, num_modules=2, init_std=0.6, seed=3)


@functools.partial(jax.jit, static_argnames="hidden_state")
def mtp_logits(modules, target, tokens, hidden, *, hidden_state: str):
    """Each MTP module's logits over a sequence, [M, B, T, V], as one program (modules.over_sequence, then the
    target's LM head)."""
    outs, _ = modules.over_sequence(tokens, hidden, target.embed[...], hidden_state)
    return jnp.stack([target.unembed(out) for out in outs])

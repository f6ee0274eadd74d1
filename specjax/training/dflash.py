"""Training a DFlash block drafter on a frozen target (DFlashTrainConfig; `specjax train-dflash`).

What is implemented, after the paper (arXiv 2602.06036) and SpecForge's recipe (specforge/core/dflash.py):
- The target runs once per batch of sequences [B, S] (from `batch_at`, a pure function of (seed, step),
  so a killed run resumes exactly), without a cache and under stop_gradient; the outputs of its
  `target_layer_ids` layers give one context feature per position.
- Each sequence carries `num_anchors` blocks at distinct random anchor positions a (drawn per step
  from (seed, step), with a + block_size <= S). A block is [x_a, mask, ..., mask] at positions
  a .. a + block_size - 1; it sees the context features of positions < a (strictly before its
  anchor, as at inference, where the anchor's own feature is not known yet) and, non-causally, its
  own block; blocks do not see one another. All blocks of a sequence run as one forward through the
  drafter's KV cache (context first, then the blocks) under one attention mask.
- Slot k >= 1 of a block predicts x_{a+k} through the target's LM head. The loss is the weighted mean
  over slots of the cross-entropy against the corpus token (the recipe's), mixed with the
  cross-entropy against the target's distribution at that position when distill_weight > 0, with
  weights exp(-(k - 1) / gamma) (gamma 7 for block 16, the recipe's). The embedding and LM head are
  the target's and stay frozen.
- The sequences are corpus windows or, with regenerate_sequences, continuations the target writes
  itself from corpus prompts (the recipe's regenerated data; specjax.data.regenerate).

Writes under output_dir: tokenizer/ and token files (data), regenerated.npy, checkpoints/, metrics.jsonl, and drafter/
(z-lab's layout, which load_dflash reads) with eval.json: the greedy mean acceptance length of the
closing held-out eval at K = eval_num_speculative_tokens and the final logged loss.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax import default_models
from specjax.config import DFlashTrainConfig, ModelConfig, SpecConfig
from specjax.data.dataset import batch_at
from specjax.data.regenerate import frozen_target_and_tokens, own_text
from specjax.models import hf
from specjax.models.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids, init_dflash, save_dflash
from specjax.models.transformer import Transformer, num_parameters, unembed
from specjax.training import loop
from specjax.training.evaluation import held_out_prompts, mean_acceptance_length
from specjax.training.lm import execution_config, fit


def drafter_config(config: DFlashTrainConfig, target_config: ModelConfig, mask_token_id: int) -> DFlashConfig:
    """The untrained drafter's shape: Qwen3 layers as wide as the target's (MLP width config.intermediate_size)."""
    layer = dataclasses.replace(target_config, num_layers=config.num_layers, qk_norm=True, qkv_bias=False,
                                intermediate_size=config.intermediate_size or target_config.intermediate_size,
                                out_bias=False, mlp_bias=False, sliding_window=None, architecture="Qwen3ForCausalLM")
    layer = execution_config(layer, config)
    ids = config.target_layer_ids
    if ids is None:
        ids = default_target_layer_ids(target_config.num_layers, config.num_layers)
    return DFlashConfig(layer=layer, target_layer_ids=tuple(ids), mask_token_id=mask_token_id,
                        block_size=config.block_size, causal=config.causal,
                        num_target_layers=target_config.num_layers)


def sample_anchors(rng: np.random.Generator, batch_size: int, seq_len: int, block_size: int,
                   num_anchors: int) -> np.ndarray:
    """[B, N] sorted distinct anchors per row in [0, seq_len - block_size] (N at most that many)."""
    choices = seq_len - block_size + 1
    count = min(num_anchors, choices)
    return np.sort(np.stack([rng.choice(choices, count, replace=False) for _ in range(batch_size)]), axis=1)


def block_attention_mask(anchors: jax.Array, seq_len: int, block_size: int) -> jax.Array:
    """[B, N * bs, S + N * bs]: block j's slots see context slots < anchors[:, j] and block j's own slots."""
    num_blocks = anchors.shape[1]
    query_block = jnp.arange(num_blocks * block_size) // block_size  # [Q]
    key_slot = jnp.arange(seq_len + num_blocks * block_size)  # [S + Q]
    sees_context = (key_slot[None, None, :] < seq_len) & (key_slot[None, None, :] < anchors[:, query_block, None])
    key_block = (key_slot - seq_len) // block_size
    sees_block = (key_slot >= seq_len)[None, :] & (key_block[None, :] == query_block[:, None])  # [Q, S + Q]
    return sees_context | sees_block[None]


def dflash_loss(drafter: DFlashDrafter, target: Transformer, tokens: jax.Array, anchors: jax.Array,
                gamma: float, distill_weight: float):
    """The module docstring's loss on sequences [B, S] with anchors [B, N]; (loss, metrics)."""
    config = drafter.config
    batch_size, seq_len = tokens.shape
    block_size, num_blocks = config.block_size, anchors.shape[1]
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), tokens.shape)
    target_logits, hidden, _ = target(tokens, positions, hidden_layers=config.hidden_layers,
                                      compute_logits=distill_weight > 0)
    context = drafter.context(jax.lax.stop_gradient(hidden))
    cache = drafter.create_cache(batch_size, seq_len + num_blocks * block_size)
    cache = drafter.write_context(context, positions, cache)

    rows = jnp.arange(batch_size)[:, None, None]
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    label_positions = anchors[:, :, None] + offsets  # [B, N, bs]
    block = jnp.full((batch_size, num_blocks, block_size), config.mask_token_id, jnp.int32)
    block = block.at[:, :, 0].set(tokens[rows[:, :, 0], anchors])
    mask = block_attention_mask(anchors, seq_len, block_size)
    out, _ = drafter(block.reshape(batch_size, -1), label_positions.reshape(batch_size, -1), cache,
                     target.embed[...], attention_mask=mask)
    lm_head = None if target.lm_head is None else target.lm_head[...]
    logits = unembed(out, target.embed[...], lm_head, target.config.jnp_dtype)
    log_probs = jax.nn.log_softmax(logits.reshape(batch_size, num_blocks, block_size, -1), axis=-1)

    labels = tokens[rows, label_positions]  # [B, N, bs]
    ce = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    if distill_weight > 0:  # the target's distribution of x_{a+k} is its output at position a + k - 1
        wanted = jax.nn.softmax(jax.lax.stop_gradient(target_logits)[rows, jnp.maximum(label_positions - 1, 0)], -1)
        ce = (1 - distill_weight) * ce - distill_weight * (wanted * log_probs).sum(-1)
    slot = offsets.astype(jnp.float32)
    weights = jnp.where(offsets >= 1, jnp.exp(-(slot - 1) / gamma), 0.0)  # [bs]; the anchor predicts nothing
    loss = (ce * weights).sum() / (weights.sum() * batch_size * num_blocks)
    correct = (jnp.argmax(log_probs, -1) == labels)[..., 1:]
    metrics = {"accuracy": correct.mean(), "accuracy_1": correct[..., 0].mean(),
               # expected accepted run of a block if the slots' hits were the drafts' acceptances
               "accepted_prefix": jnp.cumprod(correct, axis=-1).sum(-1).mean()}
    return loss, metrics


def mask_token_for(config: DFlashTrainConfig, target_dir: Path, vocab_size: int) -> int:
    if config.mask_token_id is not None:
        return config.mask_token_id
    pad = hf.read_config_json(target_dir).get("pad_token_id")
    return int(pad) if pad is not None else vocab_size - 1


def closing_eval(config: DFlashTrainConfig, target: Transformer, drafter: DFlashDrafter,
                 held_out_tokens: np.ndarray) -> dict:
    """Greedy acceptance on the held-out prompts of config (the same prompts as the other drafters' evals)."""
    prompts = held_out_prompts(held_out_tokens, config.eval_prompts, config.eval_prompt_len, config.seed)
    spec = SpecConfig(method="dflash", num_speculative_tokens=config.eval_num_speculative_tokens or config.block_size - 1)
    return mean_acceptance_length(target, spec, drafter, prompts, config.eval_new_tokens)


def train_dflash(config: DFlashTrainConfig) -> dict:
    output_dir, target, train_tokens, held_out_tokens = frozen_target_and_tokens(config)
    target_dir, data = default_models.resolve(config.target), config.data
    drafter_shape = drafter_config(config, target.config, mask_token_for(config, target_dir, target.config.vocab_size))
    drafter = init_dflash(drafter_shape, seed=config.seed)

    def loss_fn(drafter, batch, target):
        loss, metrics = dflash_loss(drafter, target, batch["tokens"], batch["anchors"], config.decay_gamma,
                                    config.distill_weight)
        return loss, {"loss": loss, **metrics}

    sequences = own_text(config, target, train_tokens, output_dir)

    def batch_fn(step):  # a function of (seed, step), as the windows are: a resumed run sees the same blocks
        rng = np.random.default_rng([config.seed, step, 2])
        if sequences is None:
            tokens = batch_at(train_tokens, step, data.batch_size, data.seq_len, config.seed)[:, :data.seq_len]
        else:
            tokens = sequences[rng.integers(0, len(sequences), data.batch_size), :data.seq_len]
        anchors = sample_anchors(rng, data.batch_size, data.seq_len, config.block_size, config.num_anchors)
        return {"tokens": tokens, "anchors": anchors.astype(np.int32)}

    trained = fit(drafter, loss_fn, batch_fn, config, output_dir, description="train-dflash", frozen=target,
                  model_config=drafter.config.layer)
    drafter_dir = output_dir / "drafter"
    save_dflash(trained, drafter_dir)
    acceptance = closing_eval(config, target, trained, held_out_tokens)
    records = loop.read_metrics(output_dir / "metrics.jsonl")
    summary = {"kind": "dflash", "mean_acceptance_length": acceptance["mean_acceptance_length"],
               "acceptance_rate": acceptance["acceptance_rate"],
               "per_position_acceptance": acceptance["per_position_acceptance"],
               "final_loss": records[-1]["loss"] if records else float("nan"),
               "steps": config.optimizer.total_steps, "block_size": config.block_size,
               "target_layer_ids": list(trained.config.target_layer_ids), "parameters": num_parameters(trained),
               "num_speculative_tokens": config.eval_num_speculative_tokens or config.block_size - 1,
               "eval_prompts": config.eval_prompts}
    (drafter_dir / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary

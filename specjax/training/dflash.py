"""Training a DFlash block drafter on a frozen target (DFlashTrainConfig; `specjax train-dflash`), or a
DSpark drafter (DSparkTrainConfig; `specjax train-dspark`): the same backbone and recipe, extended.

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

DSpark (specjax.models.dspark) adds, after DeepSpec (deepspec/modeling/dspark):
- With sample_from_anchor the anchor's slot predicts x_{a+1} and slot k predicts x_{a+k+1} (a + block_size
  < S); draft d's loss weight is exp(-(d - 1) / gamma) either way.
- The Markov head is trained jointly: every slot's logits carry W2 . W1[x] of the true previous token x
  (teacher forcing; the drafts before an accepted draft are those tokens).
- The confidence head's loss (weight confidence_head_alpha) is the binary cross-entropy of its logit against
  the acceptance the block observes: whether the slot's greedy draft (argmax of its logits) is the target's
  argmax token there, over the drafts whose predecessors in the block were all accepted (the event its
  estimate is conditioned on). Its inputs, the backbone's hidden states, are held fixed for it, so the
  backbone trains on DFlash's loss alone. (DeepSpec's target is the probabilistic acceptance 1 - TV(p, q);
  the greedy comparison here is what greedy verification accepts.)

Writes under output_dir: tokenizer/ and token files (data), regenerated.npy, checkpoints/, metrics.jsonl, and drafter/
(z-lab's layout, which load_dflash reads; DeepSpec's for DSpark, which load_dspark reads) with eval.json: the greedy mean acceptance length of the
closing held-out eval at K = eval_num_speculative_tokens and the final logged loss.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax import default_models
from specjax.config import DFlashTrainConfig, DSparkTrainConfig, ModelConfig, SpecConfig
from specjax.data.dataset import batch_at
from specjax.data.regenerate import frozen_target_and_tokens, own_text
from specjax.models import hf
from specjax.models.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids, init_dflash, save_dflash
from specjax.models.dspark import DSparkDrafter, dspark_config, init_dspark, save_dspark
from specjax.models.transformer import Transformer, num_parameters, unembed
from specjax.training import loop
from specjax.training.evaluation import held_out_prompts, mean_acceptance_length
from specjax.training.lm import execution_config, fit


def drafter_config(config: DFlashTrainConfig, target_config: ModelConfig, mask_token_id: int) -> DFlashConfig:
    """The untrained drafter's shape: Qwen3 layers as wide as the target's (MLP width config.intermediate_size);
    with a DSparkTrainConfig, a DSparkConfig with its heads."""
    layer = dataclasses.replace(target_config, num_layers=config.num_layers, qk_norm=True, qkv_bias=False,
                                intermediate_size=config.intermediate_size or target_config.intermediate_size,
                                out_bias=False, mlp_bias=False, sliding_window=None, architecture="Qwen3ForCausalLM")
    layer = execution_config(layer, config)
    ids = config.target_layer_ids
    if ids is None:
        ids = default_target_layer_ids(target_config.num_layers, config.num_layers)
    backbone = DFlashConfig(layer=layer, target_layer_ids=tuple(ids), mask_token_id=mask_token_id,
                            block_size=config.block_size, causal=config.causal,
                            num_target_layers=target_config.num_layers)
    if not isinstance(config, DSparkTrainConfig):
        return backbone
    return dspark_config(backbone, markov_rank=config.markov_rank, markov_head_type=config.markov_head_type,
                         sample_from_anchor=config.sample_from_anchor,
                         enable_confidence_head=config.confidence_head_alpha > 0)


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


def block_outputs(drafter: DFlashDrafter, target: Transformer, tokens: jax.Array, anchors: jax.Array,
                  compute_target_logits: bool) -> dict:
    """The drafter's blocks at anchors [B, N] over sequences [B, S] (the module docstring's layout), teacher
    forced: "logits" [B, N, bs, V] of every slot (a DSpark drafter's with the Markov bias of the true previous
    token), "hidden" [B, N, bs, D], "labels" [B, N, bs] (the token each slot predicts), "previous" (the token
    before it), "draft_index" [bs] (the draft a slot makes, 1-based; 0 for DFlash's anchor slot, which
    predicts nothing) and, if asked, "target_logits" [B, N, bs, V] (the target's at the label's position)."""
    config = drafter.config
    batch_size, seq_len = tokens.shape
    block_size, num_blocks = config.block_size, anchors.shape[1]
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), tokens.shape)
    target_logits, hidden, _ = target(tokens, positions, hidden_layers=config.hidden_layers,
                                      compute_logits=compute_target_logits)
    context = drafter.context(jax.lax.stop_gradient(hidden))
    cache = drafter.create_cache(batch_size, seq_len + num_blocks * block_size)
    cache = drafter.write_context(context, positions, cache)

    rows = jnp.arange(batch_size)[:, None, None]
    offsets = np.arange(block_size, dtype=np.int32)
    block_positions = anchors[:, :, None] + offsets  # [B, N, bs]
    draft_index = offsets + 1 - config.first_draft_slot  # slot j drafts draft j + 1 - first_draft_slot
    label_positions = anchors[:, :, None] + np.maximum(draft_index, 0)
    block = jnp.full((batch_size, num_blocks, block_size), config.mask_token_id, jnp.int32)
    block = block.at[:, :, 0].set(tokens[rows[:, :, 0], anchors])
    mask = block_attention_mask(anchors, seq_len, block_size)
    out, _ = drafter(block.reshape(batch_size, -1), block_positions.reshape(batch_size, -1), cache,
                     target.embed[...], attention_mask=mask)
    lm_head = None if target.lm_head is None else target.lm_head[...]
    logits = unembed(out, target.embed[...], lm_head, target.config.jnp_dtype).reshape(batch_size, num_blocks,
                                                                                       block_size, -1)
    previous = tokens[rows, jnp.maximum(label_positions - 1, 0)]
    out = out.reshape(batch_size, num_blocks, block_size, -1)
    if isinstance(drafter, DSparkDrafter):
        logits = logits + drafter.markov_bias(previous, out)
    outputs = {"logits": logits, "hidden": out,
               "labels": tokens[rows, label_positions], "previous": previous, "draft_index": draft_index}
    if compute_target_logits:  # the target's distribution of x_p is its output at position p - 1
        outputs["target_logits"] = jax.lax.stop_gradient(target_logits)[rows, jnp.maximum(label_positions - 1, 0)]
    return outputs


def dflash_loss(drafter: DFlashDrafter, target: Transformer, tokens: jax.Array, anchors: jax.Array,
                gamma: float, distill_weight: float, confidence_alpha: float = 0.0):
    """The module docstring's loss on sequences [B, S] with anchors [B, N]; (loss, metrics). A DSpark drafter's
    logits carry its Markov bias, and with confidence_alpha > 0 its confidence head adds its loss."""
    confidence = confidence_alpha > 0
    outputs = block_outputs(drafter, target, tokens, anchors, distill_weight > 0 or confidence)
    log_probs = jax.nn.log_softmax(outputs["logits"], axis=-1)
    labels, draft_index = outputs["labels"], outputs["draft_index"]
    ce = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    if distill_weight > 0:
        wanted = jax.nn.softmax(outputs["target_logits"], -1)
        ce = (1 - distill_weight) * ce - distill_weight * (wanted * log_probs).sum(-1)
    slot = jnp.asarray(draft_index, jnp.float32)
    weights = jnp.where(draft_index >= 1, jnp.exp(-(slot - 1) / gamma), 0.0)  # DFlash's anchor slot: none
    loss = (ce * weights).sum() / (weights.sum() * labels.shape[0] * labels.shape[1])
    first = drafter.config.first_draft_slot
    correct = (jnp.argmax(log_probs, -1) == labels)[..., first:]
    metrics = {"accuracy": correct.mean(), "accuracy_1": correct[..., 0].mean(),
               # expected accepted run of a block if the slots' hits were the drafts' acceptances
               "accepted_prefix": jnp.cumprod(correct, axis=-1).sum(-1).mean()}
    if confidence:
        bce, metrics["confidence_separation"] = confidence_loss(drafter, outputs)
        metrics["confidence_loss"] = bce
        loss = loss + confidence_alpha * bce
    return loss, metrics


def observed_acceptance(outputs: dict) -> tuple[jax.Array, jax.Array]:
    """(accepted, conditioned) [B, N, K] over a block's drafts: whether each greedy draft (the argmax of its
    slot's logits) is the target's argmax token there, and whether every draft before it in the block was
    (the event its acceptance is conditioned on)."""
    first = int(np.argmax(outputs["draft_index"] >= 1))
    wanted = jnp.argmax(outputs["target_logits"], -1)[..., first:]
    accepted = (jnp.argmax(outputs["logits"], -1)[..., first:] == wanted).astype(jnp.float32)
    before = jnp.cumprod(accepted, axis=-1)
    conditioned = jnp.concatenate([jnp.ones_like(before[..., :1]), before[..., :-1]], axis=-1)
    return accepted, conditioned


def confidence_loss(drafter: DSparkDrafter, outputs: dict) -> tuple[jax.Array, jax.Array]:
    """The confidence head's binary cross-entropy against the acceptance observed in the blocks (given the
    drafts before were accepted, over those drafts only), on the backbone's hidden states held fixed; and
    the mean confidence of accepted minus that of rejected drafts (a training signal that it separates them)."""
    first = drafter.config.first_draft_slot
    accepted, conditioned = observed_acceptance(outputs)
    logit = drafter.confidence_logit(jax.lax.stop_gradient(outputs["hidden"][..., first:, :]),
                                     outputs["previous"][..., first:])
    bce = optax.sigmoid_binary_cross_entropy(logit, accepted)
    count = jnp.maximum(conditioned.sum(), 1.0)
    c = jax.nn.sigmoid(logit)
    separation = ((c * accepted * conditioned).sum() / jnp.maximum((accepted * conditioned).sum(), 1.0)
                  - (c * (1 - accepted) * conditioned).sum() / jnp.maximum(((1 - accepted) * conditioned).sum(), 1.0))
    return (bce * conditioned).sum() / count, separation


def mask_token_for(config: DFlashTrainConfig, target_dir: Path, vocab_size: int) -> int:
    if config.mask_token_id is not None:
        return config.mask_token_id
    pad = hf.read_config_json(target_dir).get("pad_token_id")
    return int(pad) if pad is not None else vocab_size - 1


def method_of(config: DFlashTrainConfig) -> str:
    """The SpecConfig.method that drafts with what config trains."""
    return "dspark" if isinstance(config, DSparkTrainConfig) else "dflash"


def closing_eval(config: DFlashTrainConfig, target: Transformer, drafter: DFlashDrafter,
                 held_out_tokens: np.ndarray) -> dict:
    """Greedy acceptance on the held-out prompts of config (the same prompts as the other drafters' evals)."""
    prompts = held_out_prompts(held_out_tokens, config.eval_prompts, config.eval_prompt_len, config.seed)
    spec = SpecConfig(method=method_of(config),
                      num_speculative_tokens=config.eval_num_speculative_tokens or config.block_size - 1)
    return mean_acceptance_length(target, spec, drafter, prompts, config.eval_new_tokens)


def train_dflash(config: DFlashTrainConfig) -> dict:
    output_dir, target, train_tokens, held_out_tokens = frozen_target_and_tokens(config)
    target_dir, data = default_models.resolve(config.target), config.data
    drafter_shape = drafter_config(config, target.config, mask_token_for(config, target_dir, target.config.vocab_size))
    dspark = isinstance(config, DSparkTrainConfig)
    drafter = (init_dspark if dspark else init_dflash)(drafter_shape, seed=config.seed)
    confidence_alpha = config.confidence_head_alpha if dspark else 0.0
    span = config.block_size + 1 - drafter_shape.first_draft_slot  # a block and its labels lie in the sequence

    def loss_fn(drafter, batch, target):
        loss, metrics = dflash_loss(drafter, target, batch["tokens"], batch["anchors"], config.decay_gamma,
                                    config.distill_weight, confidence_alpha)
        return loss, {"loss": loss, **metrics}

    sequences = own_text(config, target, train_tokens, output_dir)

    def batch_fn(step):  # a function of (seed, step), as the windows are: a resumed run sees the same blocks
        rng = np.random.default_rng([config.seed, step, 2])
        if sequences is None:
            tokens = batch_at(train_tokens, step, data.batch_size, data.seq_len, config.seed)[:, :data.seq_len]
        else:
            tokens = sequences[rng.integers(0, len(sequences), data.batch_size), :data.seq_len]
        anchors = sample_anchors(rng, data.batch_size, data.seq_len, span, config.num_anchors)
        return {"tokens": tokens, "anchors": anchors.astype(np.int32)}

    trained = fit(drafter, loss_fn, batch_fn, config, output_dir, description=f"train-{method_of(config)}",
                  frozen=target, model_config=drafter.config.layer)
    drafter_dir = output_dir / "drafter"
    (save_dspark if dspark else save_dflash)(trained, drafter_dir)
    acceptance = closing_eval(config, target, trained, held_out_tokens)
    records = loop.read_metrics(output_dir / "metrics.jsonl")
    summary = {"kind": method_of(config), "mean_acceptance_length": acceptance["mean_acceptance_length"],
               "acceptance_rate": acceptance["acceptance_rate"],
               "per_position_acceptance": acceptance["per_position_acceptance"],
               "final_loss": records[-1]["loss"] if records else float("nan"),
               "steps": config.optimizer.total_steps, "block_size": config.block_size,
               "target_layer_ids": list(trained.config.target_layer_ids), "parameters": num_parameters(trained),
               "num_speculative_tokens": config.eval_num_speculative_tokens or config.block_size - 1,
               "eval_prompts": config.eval_prompts,
               **({"markov_rank": config.markov_rank, "sample_from_anchor": config.sample_from_anchor} if dspark else {})}
    (drafter_dir / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary

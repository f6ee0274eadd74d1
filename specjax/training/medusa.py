"""Medusa-1 head training on a frozen target: loss = sum_k step_decay^k x CE of head k, where head k
(0-based) reads the target's final hidden state at position t and predicts token t + k + 2 (the
target's own LM head predicts t + 1). The heads start as the original does: zero residual blocks and
projections copied from the target's LM head, so training begins from "every head says what the
target says next".
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from specjax.config import HeadTrainConfig, SpecConfig
from specjax.data.dataset import batch_at, prepare
from specjax import default_models
from specjax.models import hf
from specjax.models.medusa import LMHead, MedusaConfig, MedusaHeads, init_medusa, save_medusa
from specjax.models.transformer import Transformer, num_parameters
from specjax.training.evaluation import held_out_prompts, mean_acceptance_length
from specjax.training.lm import fit


def medusa_loss(heads: MedusaHeads, target: Transformer, batch, step_decay: float):
    """(loss, per-head cross-entropies) on token windows [B, T + 1]."""
    inputs = batch[:, :-1]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    _, hidden, _ = target(inputs, positions, compute_logits=False)
    features = jax.lax.stop_gradient(hidden.final)  # [B, T, D]; the target stays frozen
    batch_size, length, width = features.shape
    lm_head = LMHead.of(target) if heads.config.shared_lm_head else None
    logits = heads(features.reshape(-1, width), lm_head).reshape(batch_size, length, heads.config.num_heads, -1)
    losses = []
    for k in range(heads.config.num_heads):
        shift = k + 2  # head k at position t predicts token t + k + 2
        labels = batch[:, shift:]  # [B, T + 1 - shift], for positions 0 .. T - shift
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits[:, :labels.shape[1], k], labels)
        losses.append(per_token.mean())
    losses = jnp.stack(losses)
    weights = step_decay ** jnp.arange(heads.config.num_heads, dtype=jnp.float32)
    return jnp.sum(weights * losses), losses


def train_medusa(config: HeadTrainConfig) -> dict:
    if config.kind != "medusa":
        raise ValueError(f"train_medusa needs HeadTrainConfig.kind 'medusa', got {config.kind!r}")
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    target_dir = default_models.resolve(config.target)
    target = hf.load(target_dir, dtype=config.compute_dtype)
    data = dataclasses.replace(config.data, tokenizer=str(target_dir))
    _, train_tokens, held_out_tokens = prepare(data, Path(data.cache_dir or output_dir))
    heads = init_medusa(MedusaConfig(num_heads=config.num_heads, hidden_size=target.config.hidden_size,
                                     vocab_size=target.config.vocab_size, num_layers=config.num_layers,
                                     shared_lm_head=config.shared_lm_head,
                                     # float32 master weights when the run sets a compute dtype
                                     param_dtype="float32" if config.compute_dtype else target.config.param_dtype,
                                     dtype=target.config.dtype),
                        target=target, seed=config.seed)
    untrained = heads

    def loss_fn(heads, batch, target):
        loss, per_head = medusa_loss(heads, target, batch, config.step_decay)
        return loss, {"loss": loss, **{f"ce_head{k}": ce for k, ce in enumerate(per_head)}}

    def batch_fn(step):
        return batch_at(train_tokens, step, data.batch_size, data.seq_len, config.seed)

    heads = fit(heads, loss_fn, batch_fn, config, output_dir, description="train-medusa", frozen=target,
                model_config=target.config)
    head_dir = output_dir / "heads"
    save_medusa(heads, head_dir, base_model_name_or_path=str(config.target))
    prompts = held_out_prompts(held_out_tokens, config.eval_prompts, config.eval_prompt_len, config.seed)
    spec = SpecConfig(method="medusa", num_speculative_tokens=min(config.eval_num_speculative_tokens,
                                                                  config.num_heads))
    summary = {
        "steps": config.optimizer.total_steps,
        "parameters": num_parameters(heads),
        "mean_acceptance_length": mean_acceptance_length(target, spec, heads, prompts,
                                                         config.eval_new_tokens)["mean_acceptance_length"],
        "untrained_mean_acceptance_length": mean_acceptance_length(
            target, spec, untrained, prompts, config.eval_new_tokens)["mean_acceptance_length"],
        "num_speculative_tokens": spec.num_speculative_tokens,
        "eval_prompts": len(prompts),
    }
    (head_dir / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary

"""Training EAGLE-1 and EAGLE-3 draft heads on a frozen target (HeadTrainConfig, kind 'eagle1' / 'eagle3').

The target runs once per batch (a window of T + 1 tokens from `batch_at`, a pure function of (seed,
step), so a killed run resumes exactly) without a cache and under stop_gradient; its hidden states are
the head's inputs and its distributions the labels. The head runs causally over the window's T pairs
(feature f_j, token x_{j+1}) without a cache (the full forward's flash attention on GPUs), as drafting
commits them into a fresh cache. Offline training: target_hidden once per batch, stored, then
eagle1_head_loss / eagle3_head_loss over it and the target's TargetVocabulary. Objectives:
- EAGLE-1: SmoothL1 of the head's predicted feature against the target's next feature (inputs noised
  by U(-feature_noise, feature_noise)), plus 0.1 x the cross-entropy of the target's LM head on the two.
- EAGLE-3 (training-time test): over `unroll_steps` steps fed the head's own earlier predictions,
  step_decay-weighted cross-entropy against the target's next-token distribution restricted to the
  draft vocabulary; no feature loss.
A draft vocabulary (draft_vocab_size) is the most frequent training ids; EAGLE-1 (FR-Spec) trains as
without one and only drafts from it. The full derivation: docs/training.md, "The heads' objectives".

Writes under output_dir: tokenizer/ and token files (data), checkpoints/, metrics.jsonl, and head/ (the
public EAGLE layout that load_eagle reads) with eval.json: the greedy mean acceptance length of the
closing held-out eval and the final logged loss.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.config import HeadTrainConfig, SpecConfig
from specjax.data.dataset import batch_at, prepare
from specjax import default_models
from specjax.models import hf
from specjax.models.eagle import EagleConfig, EagleHead, default_fuse_layers, init_eagle, save_eagle
from specjax.models.transformer import Hidden, Transformer, num_parameters, unembed
from specjax.models.vocabulary import draft_vocabulary, restricted_unembedding
from specjax.training import loop
from specjax.training.evaluation import held_out_prompts, mean_acceptance_length
from specjax.training.lm import execution_config, fit

EAGLE_KINDS = {"eagle1": (1, "eagle"), "eagle3": (3, "eagle3")}
CE_WEIGHT = 0.1  # EAGLE-1's weight of the distribution loss against the feature regression


def build_head(config: HeadTrainConfig, target_config, train_tokens: np.ndarray) -> EagleHead:
    """The untrained head of config (seeded by config.seed), with its draft vocabulary set."""
    if config.kind not in EAGLE_KINDS:
        raise ValueError(f"train_eagle trains kind 'eagle1' or 'eagle3', got {config.kind!r}")
    version, _ = EAGLE_KINDS[config.kind]
    layer = execution_config(dataclasses.replace(target_config, num_layers=1), config)
    fuse_layers, draft_vocab = (), None
    if version == 3:
        fuse_layers = tuple(config.fuse_layers) if config.fuse_layers is not None \
            else default_fuse_layers(target_config.num_layers)
    if config.draft_vocab_size is not None and config.draft_vocab_size < target_config.vocab_size:
        draft_vocab = config.draft_vocab_size
    head = init_eagle(EagleConfig(layer=layer, version=version, fuse_layers=fuse_layers,
                                  draft_vocab_size=draft_vocab), seed=config.seed)
    if draft_vocab is not None:
        ids = draft_vocabulary(train_tokens, target_config.vocab_size, draft_vocab)
        head.draft_to_target.set_value(jnp.asarray(ids))
    return head


@functools.partial(jax.tree_util.register_dataclass, data_fields=("embed", "lm_head"),
                   meta_fields=("dtype", "matmul_precision"))
@dataclasses.dataclass(frozen=True)
class TargetVocabulary:
    """The frozen target's token embedding and unembedding (lm_head None: tied to embed): all a head's loss
    reads of the target besides its hidden states, so all of it that training from stored features keeps."""

    embed: jax.Array
    lm_head: jax.Array | None
    dtype: str
    matmul_precision: str = "auto"

    @classmethod
    def of(cls, target: Transformer) -> "TargetVocabulary":
        c = target.config
        return cls(target.embed[...], None if target.lm_head is None else target.lm_head[...], c.dtype,
                   c.matmul_precision)

    def unembed(self, features, ids=None):
        """Float32 logits of features over the whole vocabulary, or only over the target ids `ids`."""
        lm_head = self.lm_head if ids is None else restricted_unembedding(self.embed, self.lm_head, ids)
        return unembed(features, self.embed, lm_head, jnp.dtype(self.dtype), self.matmul_precision)


def target_hidden(target: Transformer, batch, fuse_layers: tuple[int, ...] = ()) -> Hidden:
    """The frozen target's hidden states over a window batch [B, T + 1] that a head's loss reads, under
    stop_gradient: final (EAGLE-1's features, and the labels of both) and, for EAGLE-3, the inputs of
    fuse_layers. What training from stored features (offline) computes once per batch and keeps."""
    positions = jnp.broadcast_to(jnp.arange(batch.shape[1], dtype=jnp.int32), batch.shape)
    _, hidden, _ = target(batch, positions, compute_logits=False, hidden_layers=fuse_layers)
    return jax.lax.stop_gradient(hidden)


def eagle1_loss(head: EagleHead, target: Transformer, batch, noise):
    """EAGLE-1's loss on one window batch [B, T + 1] with the feature noise [B, T, D] (module
    docstring), the target run inside; (loss, metrics)."""
    return eagle1_head_loss(head, TargetVocabulary.of(target), batch, target_hidden(target, batch), noise)


def eagle1_head_loss(head: EagleHead, vocabulary: TargetVocabulary, batch, hidden: Hidden, noise):
    """eagle1_loss from the target's hidden states over batch (target_hidden's, computed here or stored)."""
    all_positions = jnp.broadcast_to(jnp.arange(batch.shape[1], dtype=jnp.int32), batch.shape)
    features = jax.lax.stop_gradient(hidden.final.astype(jnp.float32))  # f_0 .. f_T
    inputs, wanted = features[:, :-1], features[:, 1:]
    inputs = inputs + noise.astype(inputs.dtype)
    predicted, _ = head(batch[:, 1:], inputs, all_positions[:, :-1], None, vocabulary.embed)
    predicted = predicted.astype(jnp.float32)
    feature_loss = optax.huber_loss(predicted, wanted, delta=1.0).mean()
    target_probs = jax.lax.stop_gradient(jax.nn.softmax(vocabulary.unembed(wanted), -1))
    head_logits = vocabulary.unembed(predicted)
    ce = -(target_probs * jax.nn.log_softmax(head_logits, -1)).sum(-1).mean()
    accuracy = (jnp.argmax(head_logits, -1) == jnp.argmax(target_probs, -1)).mean()
    loss = feature_loss + CE_WEIGHT * ce
    return loss, {"feature_loss": feature_loss, "ce": ce, "accuracy": accuracy}


def eagle3_loss(head: EagleHead, target: Transformer, batch, unroll_steps: int, step_decay: float):
    """EAGLE-3's training-time-test loss on one window batch [B, T + 1] (module docstring), the target run
    inside; (loss, metrics)."""
    hidden = target_hidden(target, batch, head.config.fuse_layers)
    return eagle3_head_loss(head, TargetVocabulary.of(target), batch, hidden, unroll_steps, step_decay)


def eagle3_head_loss(head: EagleHead, vocabulary: TargetVocabulary, batch, hidden: Hidden, unroll_steps: int,
                     step_decay: float):
    """eagle3_loss from the target's hidden states over batch (target_hidden's, computed here or stored)."""
    batch_size, seq_len = batch.shape[0], batch.shape[1] - 1
    all_positions = jnp.broadcast_to(jnp.arange(seq_len + 1, dtype=jnp.int32), batch.shape)
    hidden = jax.lax.stop_gradient(hidden)
    d2t = head.draft_to_target[...]
    # The target's distribution restricted to the draft ids and renormalised there is the softmax of its
    # logits at those ids: only those columns of the unembedding are multiplied ([B, T, Vd], not [B, T, V]).
    target_probs = jax.nn.softmax(vocabulary.unembed(hidden.final[:, 1:], d2t), -1)  # [B, T, Vd]
    fused = head.fuse(jax.tree.map(lambda x: x[..., :-1, :], hidden))  # F_0 .. F_{T-1}
    tokens, positions = batch[:, 1:], all_positions[:, :-1]
    features, loss, metrics = fused, 0.0, {}
    for step in range(unroll_steps):
        out, _ = head(tokens, features, positions, None, vocabulary.embed)  # no cache: flash attention
        draft_logits, _ = head.draft_logits(out, vocabulary.unembed)  # [B, T, Vd], in d2t's order
        ce = -(target_probs * jax.nn.log_softmax(draft_logits, -1)).sum(-1)  # [B, T]
        valid = (jnp.arange(seq_len) >= step)[None, :]
        step_ce = jnp.where(valid, ce, 0.0).sum() / (valid.sum() * batch_size)
        loss = loss + step_decay ** step * step_ce
        if step == 0:
            metrics["ce_0"] = step_ce
            metrics["accuracy_0"] = (jnp.argmax(draft_logits, -1) == jnp.argmax(target_probs, -1)).mean()
        features = jnp.concatenate([fused[:, :1], out[:, :-1].astype(fused.dtype)], axis=1)
    metrics[f"ce_{unroll_steps - 1}"] = step_ce
    return loss, metrics


def noise_rows(step: int, batch_size: int) -> np.ndarray:
    """The ids [batch_size] of a step's rows, which feature_noise draws from (uint32, wrapping)."""
    return ((np.arange(batch_size, dtype=np.uint64) + step * batch_size) % 2 ** 32).astype(np.uint32)


def feature_noise(rows, shape: tuple[int, int], amplitude: float, seed: int):
    """EAGLE-1's feature noise, uniform in [-amplitude, amplitude), [B, *shape] for the rows' ids [B] (noise_rows):
    drawn on the device, since a host-drawn array of [batch, seq, hidden] float32 is a numpy draw and a transfer
    every step; a function of (seed, row id), so that a resumed run and each micro-batch of an accumulated step
    draw the same."""
    key = jax.random.key(seed)
    return jax.vmap(lambda row: jax.random.uniform(jax.random.fold_in(key, row), shape, jnp.float32,
                                                   -amplitude, amplitude))(rows)


def closing_eval(config: HeadTrainConfig, target: Transformer, head: EagleHead, held_out_tokens: np.ndarray) -> dict:
    """Greedy acceptance of head on the held-out prompts of config (the same prompts for any head)."""
    _, method = EAGLE_KINDS[config.kind]
    prompts = held_out_prompts(held_out_tokens, config.eval_prompts, config.eval_prompt_len, config.seed)
    spec = SpecConfig(method=method, num_speculative_tokens=config.eval_num_speculative_tokens)
    return mean_acceptance_length(target, spec, head, prompts, config.eval_new_tokens)


def train_eagle(config: HeadTrainConfig) -> dict:
    if config.kind not in EAGLE_KINDS:
        raise ValueError(f"train_eagle trains kind 'eagle1' or 'eagle3', got {config.kind!r}")
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    target_dir = default_models.resolve(config.target)
    data = dataclasses.replace(config.data, tokenizer=str(target_dir))
    tokenizer, train_tokens, held_out_tokens = prepare(data, Path(data.cache_dir or output_dir))
    target = hf.load(target_dir, dtype=config.compute_dtype)
    if len(tokenizer) > target.config.vocab_size:
        raise ValueError(f"the tokenizer of {config.target} has {len(tokenizer)} tokens, more than the target's "
                         f"vocab_size {target.config.vocab_size}")
    head = build_head(config, target.config, train_tokens)
    noise_shape = (data.seq_len, target.config.hidden_size)

    def loss_fn(head, batch, target):
        if head.config.version == 1:
            noise = feature_noise(batch["noise_rows"], noise_shape, config.feature_noise, config.seed)
            loss, metrics = eagle1_loss(head, target, batch["tokens"], noise)
        else:
            loss, metrics = eagle3_loss(head, target, batch["tokens"], config.unroll_steps, config.step_decay)
        return loss, {"loss": loss, **metrics}

    def batch_fn(step):
        batch = {"tokens": batch_at(train_tokens, step, data.batch_size, data.seq_len, config.seed)}
        if head.config.version == 1:
            batch["noise_rows"] = noise_rows(step, data.batch_size)
        return batch

    trained = fit(head, loss_fn, batch_fn, config, output_dir, description=f"train-eagle ({config.kind})",
                  frozen=target, model_config=head.config.layer)
    head_dir = output_dir / "head"
    save_eagle(trained, head_dir)
    acceptance = closing_eval(config, target, trained, held_out_tokens)
    records = loop.read_metrics(output_dir / "metrics.jsonl")
    summary = {"kind": config.kind, "mean_acceptance_length": acceptance["mean_acceptance_length"],
               "acceptance_rate": acceptance["acceptance_rate"],
               "per_position_acceptance": acceptance["per_position_acceptance"],
               "final_loss": records[-1]["loss"] if records else float("nan"),
               "steps": config.optimizer.total_steps, "draft_vocab_size": trained.config.draft_vocab,
               "fuse_layers": list(trained.config.fuse_layers),
               "parameters": num_parameters(trained),
               "num_speculative_tokens": config.eval_num_speculative_tokens, "eval_prompts": config.eval_prompts}
    (head_dir / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary

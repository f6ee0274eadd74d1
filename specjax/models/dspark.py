"""DSpark: DFlash's parallel block backbone with a sequential low-rank Markov head and a confidence head
(DeepSeek and PKU, "DSpark: Confidence-Scheduled Speculative Decoding with Semi-Autoregressive
Generation", arXiv 2607.05147; training code deepseek-ai/DeepSpec, serving vLLM's spec_decode/dspark).

The backbone is specjax.models.dflash's drafter, unchanged: one forward over the block gives every slot's
base logits through the target's LM head. Two small heads sit on it:
- Markov head: logits_k = base_k + W2 . W1[x_{k-1}] (vanilla), with W1 = markov_w1 [V, r], W2 = markov_w2
  [r, V] and x_0 the anchor (the last committed token); or W2 . (g_k * W1[x_{k-1}]) (gated), with the gate
  g_k = sigmoid(G . [h_k, W1[x_{k-1}]] + g) from the drafting slot's hidden state h_k. Drafting is sequential
  over the block for this bias only (x_{k-1} is the draft just drawn). Rank 0 is DFlash.
- Confidence head: c_k = sigmoid(w . [h_k, W1[x_{k-1}]] + b) from the hidden state h_k of the slot that
  drafts k, the estimated probability that draft k is accepted given that draft k - 1 was.
With `sample_from_anchor` (DeepSpec's and vLLM's layout) the anchor's slot drafts the first token, so a
block of block_size slots drafts up to block_size tokens; without it the slot after the anchor does, as
in DFlash (up to block_size - 1).

Checkpoints follow DeepSpec's Qwen3 DSpark model (deepspec/modeling/dspark/qwen3/modeling.py, read for the
names): architecture `Qwen3DSparkModel`, DFlash's backbone tensors (fc, hidden_norm, norm, layers.{i}.*),
`markov_head.markov_w1.weight` [V, r] (an Embedding), `markov_head.markov_w2.weight` [V, r] (a Linear r -> V),
the gated head's `markov_head.gate_proj.weight` [r, D + r] and `.bias` [r], `confidence_head.proj.weight`
[1, D + r] and `confidence_head.proj.bias` [1]; config fields `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`, `block_size`, `mask_token_id`,
`target_layer_ids`. DeepSpec's checkpoints also carry copies of the target's `embed_tokens.weight` and
`lm_head.weight`, which are not read (the target's own are used) and not written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from specjax.config import ModelConfig, require
from specjax.models import dflash, hf
from specjax.models.transformer import einsum_f32, init_param

ARCHITECTURE = "Qwen3DSparkModel"
# DeepSpec's head types are vanilla, gated and rnn (a GRU over the block); rnn is not implemented here.
MARKOV_HEAD_TYPES = ("vanilla", "gated")
# Copies of the target's weights in DeepSpec's checkpoints, read from the target instead.
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")


@dataclasses.dataclass(frozen=True)
class DSparkConfig(dflash.DFlashConfig):
    """A DFlash backbone's shape (DFlashConfig's fields) and DSpark's heads."""

    # Rank r of the Markov head's W1 [V, r] and W2 [r, V] (256 in DeepSeek-V4); 0: no Markov head (DFlash).
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    # True: the anchor's slot drafts the first token (DeepSpec's layout); False: the slot after it (DFlash's).
    sample_from_anchor: bool = True
    enable_confidence_head: bool = True

    def __post_init__(self):
        super().__post_init__()
        require(isinstance(self.markov_rank, int) and not isinstance(self.markov_rank, bool) and self.markov_rank >= 0,
                "DSparkConfig", "markov_rank", self.markov_rank, "an integer >= 0 (0: no Markov head, DFlash)")
        require(self.markov_head_type in MARKOV_HEAD_TYPES, "DSparkConfig", "markov_head_type", self.markov_head_type,
                f"one of {list(MARKOV_HEAD_TYPES)}")

    @property
    def first_draft_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1


class DSparkDrafter(dflash.DFlashDrafter):
    """DFlash's drafter (fc, hidden_norm, layers, final_norm) with the Markov head (markov_w1 [V, r],
    markov_w2 [r, V], and for the gated head gate_w [D + r, r], gate_b [r]; None at rank 0) and the
    confidence head (confidence_w [D + r], confidence_b []; None without it)."""

    def __init__(self, config: DSparkConfig, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        c, rank = config.layer, config.markov_rank
        self.markov_w1 = init_param(rngs, (c.vocab_size, rank), c) if rank else None
        # Zero: an untrained head adds no bias, so training starts from the parallel drafter (as DeepSpec forks do).
        self.markov_w2 = init_param(rngs, (rank, c.vocab_size), c, "zeros") if rank else None
        gated = rank and config.markov_head_type == "gated"
        self.gate_w = init_param(rngs, (c.hidden_size + rank, rank), c) if gated else None
        self.gate_b = init_param(rngs, (rank,), c, "zeros") if gated else None
        confidence = config.enable_confidence_head
        self.confidence_w = init_param(rngs, (c.hidden_size + rank,), c, "zeros") if confidence else None
        self.confidence_b = init_param(rngs, (), c, "zeros") if confidence else None

    def markov_bias(self, previous: Int[Array, "*S"], hidden: Float[Array, "*S D"]) -> Float[Array, "*S V"]:
        """The float32 bias the Markov head adds to the base logits of the token after `previous`, drafted by
        the slot whose hidden state is `hidden` (read by the gated head only): W2 . W1[previous], or W2 .
        (gate * W1[previous]); zeros at rank 0."""
        if self.markov_w1 is None:
            return jnp.zeros((*previous.shape, self.config.layer.vocab_size), jnp.float32)
        embedded = self.markov_w1[...][previous]
        if self.gate_w is not None:
            features = jnp.concatenate([hidden.astype(jnp.float32), embedded.astype(jnp.float32)], axis=-1)
            gate_logit = features @ self.gate_w[...].astype(jnp.float32) + self.gate_b[...].astype(jnp.float32)
            gate = jax.nn.sigmoid(gate_logit)
            embedded = (gate * embedded).astype(embedded.dtype)
        return einsum_f32("...r,rv->...v", embedded, self.markov_w2[...])

    def confidence_logit(self, hidden: Float[Array, "*S D"], previous: Int[Array, "*S"]) -> Float[Array, "*S"]:
        """The confidence head's logit from the drafting slot's hidden state and the previous token (its
        sigmoid is the confidence); raises where the drafter has no confidence head."""
        if self.confidence_w is None:
            raise ValueError("this DSpark drafter has no confidence head (enable_confidence_head false)")
        features = hidden.astype(jnp.float32)
        if self.markov_w1 is not None:  # DeepSpec's confidence_head_with_markov
            features = jnp.concatenate([features, self.markov_w1[...][previous].astype(jnp.float32)], axis=-1)
        return features @ self.confidence_w[...].astype(jnp.float32) + self.confidence_b[...].astype(jnp.float32)


def init_dspark(config: DSparkConfig, seed: int = 0) -> DSparkDrafter:
    return DSparkDrafter(config, rngs=nnx.Rngs(params=seed))


def dspark_config(backbone: dflash.DFlashConfig, **heads) -> DSparkConfig:
    """A DSparkConfig with the backbone of a DFlashConfig and the head fields `heads`."""
    return DSparkConfig(**{f.name: getattr(backbone, f.name) for f in dataclasses.fields(dflash.DFlashConfig)}, **heads)


# ------------------------------------------------------------------------------------ DeepSpec's layout

def tensor_rules(config: DSparkConfig) -> list[hf.Rule]:
    rules = dflash.tensor_rules(config)
    if config.markov_rank:
        rules += [hf.same("markov_w1", "markov_head.markov_w1.weight"),
                  hf.transposed("markov_w2", "markov_head.markov_w2.weight")]
        if config.markov_head_type == "gated":
            rules += [hf.transposed("gate_w", "markov_head.gate_proj.weight"),
                      hf.same("gate_b", "markov_head.gate_proj.bias")]
    if config.enable_confidence_head:
        rules += [hf.Rule(("confidence_w",), ("confidence_head.proj.weight",), lambda w: (w.reshape(-1),),
                          lambda w: (w.reshape(1, -1),)),
                  hf.Rule(("confidence_b",), ("confidence_head.proj.bias",), lambda b: (b.reshape(()),),
                          lambda b: (b.reshape(1),))]
    return rules


def config_from_hf(raw: dict, path: Path = Path(hf.CONFIG_FILE)) -> DSparkConfig:
    """A DSpark config.json (DeepSpec's layout) as a DSparkConfig (dtypes float32; `load_dspark` sets them)."""
    architectures = raw.get("architectures") or []
    if architectures[:1] != [ARCHITECTURE]:
        raise hf.CheckpointError(f"{path}: architectures {architectures} is not a DSpark drafter: allowed "
                                 f"[{ARCHITECTURE!r}]")
    backbone = dflash.config_from_hf({**raw, "architectures": [dflash.ARCHITECTURE]}, path)
    rank = int(raw.get("markov_rank") or 0)
    if raw.get("enable_confidence_head") and rank and raw.get("confidence_head_with_markov") is False:
        raise hf.CheckpointError(f"{path}: field confidence_head_with_markov = false is not supported: allowed true "
                                 "(the confidence head reads W1[x_(k-1)]) or a drafter without a Markov head")
    try:
        return dspark_config(backbone, markov_rank=rank, markov_head_type=raw.get("markov_head_type") or "vanilla",
                             sample_from_anchor=bool(raw.get("sample_from_anchor", True)),
                             enable_confidence_head=bool(raw.get("enable_confidence_head", False)))
    except ValueError as error:
        raise hf.CheckpointError(f"{path}: {error}") from error


def config_to_hf(config: DSparkConfig) -> dict:
    """The config.json DeepSpec's model code reads back as the same drafter (its fields at the top level,
    DFlash's dflash_config kept beside them)."""
    raw = dflash.config_to_hf(config)
    return {**raw, "architectures": [ARCHITECTURE], "target_layer_ids": list(config.target_layer_ids),
            "mask_token_id": config.mask_token_id, "markov_rank": config.markov_rank,
            "markov_head_type": config.markov_head_type, "sample_from_anchor": config.sample_from_anchor,
            "enable_confidence_head": config.enable_confidence_head,
            "confidence_head_with_markov": config.enable_confidence_head and config.markov_rank > 0}


def load_dspark(folder: str | Path, target_config: ModelConfig | None = None,
                dtype: str | None = None) -> DSparkDrafter:
    """A DSpark drafter from a folder in DeepSpec's layout (see dflash.load_dflash for target_config, dtype)."""
    return dflash.load_block_drafter(folder, config_from_hf, DSparkDrafter, tensor_rules, "a DSpark drafter",
                                     target_config, dtype, ignored=TARGET_COPIES)


def save_dspark(drafter: DSparkDrafter, folder: str | Path) -> None:
    """Writes the drafter in DeepSpec's layout, without the target's embedding and LM head."""
    dflash.save_block_drafter(drafter, folder, config_to_hf(drafter.config), tensor_rules(drafter.config))


def with_random_heads(drafter: DSparkDrafter, scale: float, seed: int = 0) -> DSparkDrafter:
    """The drafter with Gaussian Markov and confidence weights of standard deviation `scale` (an untrained
    drafter's W2 is zero, so its Markov head would add nothing): for tests and measurements of the heads."""
    changed = jax.tree.map(lambda w: w, drafter)
    keys = iter(jax.random.split(jax.random.key(seed), 5))
    for name in ("markov_w1", "markov_w2", "gate_w", "confidence_w"):
        param = getattr(changed, name)
        if param is not None:
            param.set_value(scale * jax.random.normal(next(keys), param.shape, param.dtype))
    return changed

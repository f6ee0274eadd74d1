"""Medusa heads (Cai et al., 2024): K small heads on the target's final hidden state, head k
predicting the token k + 1 positions past the one the target itself predicts next.

Head k is `num_layers` residual blocks x <- x + SiLU(x W + b) followed by a vocabulary projection
(its own, or the target's LM head when `shared_lm_head`). The heads' weights are stacked on a
leading head axis so every head runs in the same einsum.

Checkpoints use the public layout of FasterDecoding/Medusa: `medusa_lm_head.safetensors` holding the
state dict of an nn.ModuleList of nn.Sequential(ResBlock * num_layers, nn.Linear(D, V, bias=False)),
i.e. `{k}.{j}.linear.weight` [D, D] and `{k}.{j}.linear.bias` [D] for block j of head k and
`{k}.{num_layers}.weight` [V, D] for its projection (torch Linear weights are [out, in]), with
`medusa_num_heads` and `medusa_num_layers` in config.json.

Dimension names: B batch, N heads, L residual blocks per head, D hidden size, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float
from safetensors.flax import save_file

from specjax.config import DTYPES, ConfigError, require_dtype_names, require_positive_ints
from specjax.models import hf
from specjax.models.transformer import Transformer, at_model_precision, einsum_f32, unembed

TENSOR_FILE = "medusa_lm_head.safetensors"
TORCH_FILE = "medusa_lm_head.pt"  # the original training code's format; needs converting first
INIT_STD = 0.02  # own vocabulary projections made without a target to copy from


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    """Shape of a set of Medusa heads; frozen (hashable) like every config here."""

    num_heads: int
    hidden_size: int
    vocab_size: int
    num_layers: int = 1  # residual blocks per head
    shared_lm_head: bool = False  # project with the target's LM head instead of one per head
    param_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self):
        require_positive_ints(self, "num_heads", "hidden_size", "vocab_size", "num_layers")
        require_dtype_names(self, "param_dtype", "dtype")


@functools.partial(jax.tree_util.register_dataclass, data_fields=("embed", "lm_head"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class LMHead:
    """A target's vocabulary projection: its lm_head, or its embedding when tied (lm_head None).
    The arrays are the target's own, so sharing them copies nothing."""

    embed: Float[Array, "V D"]
    lm_head: Float[Array, "D V"] | None

    @classmethod
    def of(cls, target: Transformer) -> LMHead:
        return cls(embed=target.embed[...], lm_head=None if target.lm_head is None else target.lm_head[...])

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... V"]:
        return unembed(x, self.embed, self.lm_head, x.dtype)


class MedusaHeads(nnx.Module):
    """Every head's weights, stacked on a leading N axis; `lm_head` is None when shared."""

    def __init__(self, config: MedusaConfig, *, rngs: nnx.Rngs):
        self.config = config
        c = config
        dtype = DTYPES[c.param_dtype]
        # Zero blocks make a new head the identity followed by its projection (the original Medusa
        # zeroes the block weights; its biases keep torch's default init, here they are zero too).
        self.block_w = nnx.Param(jnp.zeros((c.num_heads, c.num_layers, c.hidden_size, c.hidden_size), dtype))
        self.block_b = nnx.Param(jnp.zeros((c.num_heads, c.num_layers, c.hidden_size), dtype))
        self.lm_head = None if c.shared_lm_head else nnx.Param(
            INIT_STD * jax.random.normal(rngs.params(), (c.num_heads, c.hidden_size, c.vocab_size), dtype))

    @at_model_precision
    def __call__(self, hidden: Float[Array, "B D"], lm_head: LMHead | None = None, *,
                 num_heads: int | None = None) -> Float[Array, "B N V"]:
        """Float32 logits of the first num_heads heads (all by default) from final hidden states.
        lm_head is the target's projection, needed exactly when the config shares it."""
        c = self.config
        if c.shared_lm_head != (lm_head is not None):
            raise ValueError(f"MedusaHeads with shared_lm_head={c.shared_lm_head} needs lm_head "
                             f"{'given' if c.shared_lm_head else 'None'}")
        n = c.num_heads if num_heads is None else num_heads
        dtype = DTYPES[c.dtype]
        x = jnp.broadcast_to(hidden.astype(dtype)[:, None, :], (hidden.shape[0], n, c.hidden_size))
        block_w, block_b = self.block_w[...][:n].astype(dtype), self.block_b[...][:n].astype(dtype)
        for j in range(c.num_layers):
            x = x + jax.nn.silu(jnp.einsum("bnd,nde->bne", x, block_w[:, j]) + block_b[None, :, j])
        if lm_head is not None:
            return lm_head(x)
        return einsum_f32("bnd,ndv->bnv", x, self.lm_head[...][:n].astype(dtype))


def init_medusa(config: MedusaConfig, target: Transformer | None = None, seed: int = 0) -> MedusaHeads:
    """New heads: zero residual blocks and, for own projections, copies of the target's LM head when
    a target is given (as the original Medusa starts training), so each head starts as the target's
    next-token predictor; random projections otherwise."""
    heads = MedusaHeads(config, rngs=nnx.Rngs(params=seed))
    if target is None or config.shared_lm_head:
        return heads
    t = target.config
    if (t.hidden_size, t.vocab_size) != (config.hidden_size, config.vocab_size):
        raise ValueError(f"Medusa hidden_size {config.hidden_size} / vocab_size {config.vocab_size} differ from "
                         f"the target's {t.hidden_size} / {t.vocab_size}: allowed only equal sizes")
    head = LMHead.of(target)
    weight = head.embed.T if head.lm_head is None else head.lm_head  # [D, V]
    heads.lm_head.set_value(jnp.broadcast_to(weight, heads.lm_head.shape).astype(config.param_dtype))
    return heads


# ------------------------------------------------------------------------------------- checkpoints

def _block_keys(k: int, j: int) -> tuple[str, str]:
    return f"{k}.{j}.linear.weight", f"{k}.{j}.linear.bias"


def _projection_key(k: int, num_layers: int) -> str:
    return f"{k}.{num_layers}.weight"


def _layout(c: MedusaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the public layout and its (torch) shape."""
    D, V = c.hidden_size, c.vocab_size
    shapes = {}
    for k in range(c.num_heads):
        for j in range(c.num_layers):
            weight_key, bias_key = _block_keys(k, j)
            shapes[weight_key], shapes[bias_key] = (D, D), (D,)
        if not c.shared_lm_head:
            shapes[_projection_key(k, c.num_layers)] = (V, D)
    return shapes


def save_medusa(heads: MedusaHeads, folder: str | Path, *, base_model_name_or_path: str | None = None) -> None:
    """Writes config.json and medusa_lm_head.safetensors in the public Medusa layout.
    base_model_name_or_path goes into config.json, where the original Medusa code reads it. Heads
    that share the target's LM head have no projections to store; config.json then says
    "shared_lm_head": true, an extension of the public layout (the original code cannot read it)."""
    c = heads.config
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    block_w, block_b = heads.block_w[...], heads.block_b[...]
    tensors = {}
    for k in range(c.num_heads):
        for j in range(c.num_layers):
            weight_key, bias_key = _block_keys(k, j)
            tensors[weight_key] = block_w[k, j].T  # torch Linear weights are [out, in]
            tensors[bias_key] = block_b[k, j]
        if not c.shared_lm_head:
            tensors[_projection_key(k, c.num_layers)] = heads.lm_head[...][k].T
    save_file(tensors, folder / TENSOR_FILE, metadata={"format": "pt"})
    config = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers,
              "hidden_size": c.hidden_size, "vocab_size": c.vocab_size}
    if c.shared_lm_head:
        config["shared_lm_head"] = True
    if base_model_name_or_path is not None:
        config["base_model_name_or_path"] = base_model_name_or_path
    (folder / hf.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_medusa(folder: str | Path, *, param_dtype: str | None = None, dtype: str | None = None) -> MedusaHeads:
    """Loads heads saved in the public Medusa layout. hidden_size and vocab_size come from config.json
    when there, else from head 0's projection (older configs lack them). param_dtype defaults to the
    checkpoint's; dtype to param_dtype."""
    folder = Path(folder)
    hf_config = hf.read_config_json(folder, " (a Medusa folder has one with medusa_num_heads)")
    config_path = folder / hf.CONFIG_FILE
    if "medusa_num_heads" not in hf_config:
        raise hf.CheckpointError(f"{config_path}: field 'medusa_num_heads' is missing; Medusa heads need it")
    torch_hint = (f"; only {TORCH_FILE} is there: convert it (torch.load, then safetensors.torch.save_file "
                  f"as {TENSOR_FILE})") if (folder / TORCH_FILE).exists() else ""
    reader = hf.TensorReader(folder, TENSOR_FILE, index=None, missing_hint=torch_hint)
    path, stored = folder / TENSOR_FILE, reader.keys()
    num_heads, num_layers = hf_config["medusa_num_heads"], hf_config.get("medusa_num_layers", 1)
    shared = bool(hf_config.get("shared_lm_head", False))
    # Sizes from config.json, else (older configs) from head 0's projection; shared heads have none.
    first = _block_keys(0, 0)[0] if shared else _projection_key(0, num_layers)
    if first not in stored:
        raise hf.CheckpointError(f"{path}: tensor {first!r} is missing (medusa_num_layers={num_layers})")
    probe = reader.get(first)
    if probe.ndim != 2:
        raise hf.CheckpointError(f"{path}: tensor {first!r} has shape {tuple(probe.shape)}; expected 2 dimensions")
    if shared and "vocab_size" not in hf_config:
        raise hf.CheckpointError(f"{config_path}: field 'vocab_size' is missing; heads sharing the "
                              "target's LM head need it")
    param_dtype = reader.param_dtype(param_dtype)
    try:
        config = MedusaConfig(num_heads=num_heads, num_layers=num_layers,
                              hidden_size=hf_config.get("hidden_size", probe.shape[1]),
                              vocab_size=hf_config.get("vocab_size", probe.shape[0]), shared_lm_head=shared,
                              param_dtype=param_dtype, dtype=dtype or param_dtype)
    except ConfigError as error:
        raise hf.CheckpointError(f"{config_path}: {error}") from error
    layout = _layout(config)
    missing = [key for key in layout if key not in stored]
    if missing:
        raise hf.CheckpointError(f"{path}: tensor {missing[0]!r} is missing (medusa_num_heads={num_heads}, "
                              f"medusa_num_layers={num_layers})")
    hf.check_all_used(reader, set(layout), folder, f"{num_heads} heads of {num_layers} blocks")
    tensors = {}
    for key, shape in layout.items():
        tensors[key] = reader.get(key)
        if tuple(tensors[key].shape) != shape:
            raise hf.CheckpointError(f"{path}: tensor {key!r} has shape {tuple(tensors[key].shape)}; expected {shape} "
                                  f"for hidden_size={config.hidden_size}, vocab_size={config.vocab_size}")

    def stacked(key_of) -> jax.Array:  # [N, L, ...]; .T turns torch's [out, in] into [in, out]
        return jnp.stack([jnp.stack([tensors[key_of(k, j)].T for j in range(num_layers)])
                          for k in range(num_heads)]).astype(param_dtype)

    heads = nnx.eval_shape(lambda: MedusaHeads(config, rngs=nnx.Rngs(0)))
    heads.block_w.set_value(stacked(lambda k, j: _block_keys(k, j)[0]))
    heads.block_b.set_value(stacked(lambda k, j: _block_keys(k, j)[1]))
    if not shared:
        heads.lm_head.set_value(jnp.stack([tensors[_projection_key(k, num_layers)].T
                                           for k in range(num_heads)]).astype(param_dtype))
    return heads

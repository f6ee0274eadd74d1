"""DFlash: a block drafter conditioned on the target's hidden states (Chen, Liang, Liu, "DFlash: Block
Diffusion for Flash Speculative Decoding", arXiv 2602.06036).

One forward drafts a whole block. The target's hidden states at `target_layer_ids` (the outputs of
those layers) are concatenated and projected by `fc`, then normalised (`hidden_norm`): one context
feature per committed token. Every drafter layer projects the context features with its own k / v
projections (k-norm, RoPE at the token's position) into the drafter's KV cache, so the features of
a committed token are computed once. The queries are a block of block_size tokens: the last
committed token (the anchor) followed by block_size - 1 copies of `mask_token_id`, embedded with the
target's embedding and run through the drafter's (Qwen3) layers, which see the cached context and,
non-causally by default, the whole block; slot i of the block predicts the token at its own position
through the target's LM head (slot 0, the anchor, predicts nothing). The drafter has no embedding
or LM head of its own.

Checkpoints use the layout of z-lab's released drafters (e.g. z-lab/Qwen3-8B-DFlash-b16, read from
their model code): a Qwen3 config.json with `dflash_config` {target_layer_ids, mask_token_id,
block_size, causal}, `block_size` and `num_target_layers`; tensors `fc.weight` [D, N * D_target],
`hidden_norm.weight`, `norm.weight` and `layers.{i}.*` named as Qwen3's decoder layers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from specjax.config import ModelConfig, require
from specjax.models import hf
from specjax.models.kv_cache import KVCache
from specjax.models.vocabulary import with_draft_ids
from specjax.models.transformer import (DecodingLayer, Hidden, StackedLayers, at_model_precision, checkpointed,
                                        decoder_layer, init_param, normalize, project_qkv, query_slots_for, scan_layers)

ARCHITECTURE = "DFlashDraftModel"


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter's shape and what it reads from its target."""

    # The drafter's decoder layers (Qwen3: per-head q / k norms); vocab_size and hidden_size are the
    # target's, whose embedding and LM head it uses.
    layer: ModelConfig
    # Target layers whose outputs make the context feature (transformers' hidden_states[i + 1]).
    target_layer_ids: tuple[int, ...]
    # The token that fills the block after the anchor (an id of the target's vocabulary).
    mask_token_id: int
    # The block the drafter was trained on: anchor + block_size - 1 drafts at most.
    block_size: int = 16
    # False: the block's tokens see one another (the released drafters); True: causally.
    causal: bool = False
    # Depth of the target it was trained for.
    num_target_layers: int = 0

    def __post_init__(self):
        require(len(self.target_layer_ids) >= 1, "DFlashConfig", "target_layer_ids", self.target_layer_ids,
                "one target layer or more")
        top = self.num_target_layers - 1
        require(all(0 <= i <= top for i in self.target_layer_ids), "DFlashConfig", "target_layer_ids",
                self.target_layer_ids, f"layers 0..{top} (num_target_layers - 1)")
        require(0 <= self.mask_token_id < self.layer.vocab_size, "DFlashConfig", "mask_token_id",
                self.mask_token_id, f"an id of the vocabulary, 0..{self.layer.vocab_size - 1}")
        require(self.block_size >= 2, "DFlashConfig", "block_size", self.block_size, "an integer >= 2")
        require(self.layer.sliding_window is None, "DFlashConfig", "layer.sliding_window",
                self.layer.sliding_window, "None (full attention)")

    @property
    def first_draft_slot(self) -> int:
        """The block slot that predicts the first draft: 1, the slot after the anchor (z-lab's layout)."""
        return 1

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target's Hidden.layers entries it reads: entry i + 1 is the output of layer i. The last
        layer's output is Hidden.final instead, normed as in transformers' hidden_states."""
        return tuple(i + 1 for i in self.target_layer_ids if i + 1 < self.num_target_layers)

    def target_features(self, hidden: Hidden) -> list[Float[Array, "B T D"]]:
        """The outputs of target_layer_ids, in order, from a target forward run with hidden_layers."""
        layers = iter([] if hidden.layers is None else list(hidden.layers))
        return [hidden.final if i + 1 == self.num_target_layers else next(layers) for i in self.target_layer_ids]


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default choice: layers spread evenly from 1 to num_target_layers - 3 (the middle layer
    for a one-layer drafter)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(start + round(i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers))


class DFlashDrafter(nnx.Module):
    """The drafter's own weights: fc and hidden_norm (context features), the decoder layers (stacked,
    or per layer in the decoding layout) and the final norm."""

    def __init__(self, config: DFlashConfig, *, rngs: nnx.Rngs):
        c = config.layer
        self.config = config
        self.fc = init_param(rngs, (len(config.target_layer_ids) * c.hidden_size, c.hidden_size), c)
        self.hidden_norm = init_param(rngs, (c.hidden_size,), c, "ones")
        self.layers: StackedLayers | nnx.List = StackedLayers(c, rngs=rngs)
        self.final_norm = init_param(rngs, (c.hidden_size,), c, "ones")
        # FR-Spec: the target ids the drafter drafts (with_draft_vocabulary); None: every id.
        self.draft_to_target = None

    @at_model_precision
    def context(self, target_hidden: Hidden) -> Float[Array, "B T D"]:
        """Context features from the target's hidden states (a forward run with config.hidden_layers)."""
        c = self.config.layer
        fused = jnp.concatenate(self.config.target_features(target_hidden), axis=-1)  # [B, T, N * D]
        fused = fused.astype(c.jnp_dtype)
        projected = jnp.einsum("btf,fd->btd", fused, self.fc[...].astype(c.jnp_dtype))
        return normalize(projected, self.hidden_norm[...], None, c)

    @at_model_precision
    def write_context(self, context: Float[Array, "B C D"], positions: Int[Array, "B C"], cache: KVCache) -> KVCache:
        """Every layer's keys and values of C context features, written at each row's fill level; the
        cache comes back with lengths + C."""
        return self.write_kv(self.context_kv(context, positions), cache)

    @at_model_precision
    def context_kv(self, context: Float[Array, "B C D"], positions: Int[Array, "B C"]) -> tuple | list:
        """Every layer's keys and values [B, C, Hkv, D] of C context features: stacked by layer in a pair, or
        a list of pairs in the decoding layout (scan_layers' outs)."""
        c = self.config.layer

        def project(carry, layer, index):
            _, k, v = project_qkv(context, layer, positions, c)
            return carry, (k, v)

        return scan_layers(project, None, self.layers, c.num_layers)[1]

    def write_kv(self, kv: tuple | list, cache: KVCache) -> KVCache:
        """context_kv's keys and values written at each row's fill level; the cache comes back with lengths + C."""
        def write(cache, layer, index):
            k, v = kv[index] if isinstance(kv, list) else (kv[0][index], kv[1][index])
            return cache.write(index, k, v), None

        cache, _ = scan_layers(write, cache, self.layers, self.config.layer.num_layers)
        return cache.with_lengths(cache.lengths + jax.tree.leaves(kv)[0].shape[-3])

    @at_model_precision
    def __call__(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"], cache: KVCache,
                 embed: Float[Array, "V D"], *, attention_mask: Bool[Array, "B T S"] | None = None,
                 ) -> tuple[Float[Array, "B T D"], KVCache]:
        """Final-normed hidden states of a block of T tokens written after each row's fill level (the
        cache comes back with lengths + T); `embed` is the target's embedding. attention_mask: which
        cache slots each token sees, in place of the config's rule (training packs many blocks)."""
        c = self.config.layer
        x = embed[tokens].astype(c.jnp_dtype)
        slots = query_slots_for(tokens.shape[0], tokens.shape[1], cache)

        def step(carry, layer, index):
            x, cache = carry
            out, cache = decoder_layer(x, layer, index, positions, slots, cache, c, causal=self.config.causal,
                                       visible=attention_mask)
            return (out, cache), None

        if isinstance(self.layers, StackedLayers):  # the decoding layout's per-layer cache takes a Python index
            step = checkpointed(step, c)
        (x, cache), _ = scan_layers(step, (x, cache), self.layers, c.num_layers)
        return normalize(x, self.final_norm[...], None, c), cache.with_lengths(cache.lengths + tokens.shape[1])

    def create_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """An empty KV cache for the drafter's layers, laid out for them (see Transformer.create_cache)."""
        return KVCache.create(self.config.layer, batch_size, max_length, dtype,
                              per_layer=not isinstance(self.layers, StackedLayers))


def init_dflash(config: DFlashConfig, seed: int = 0) -> DFlashDrafter:
    return DFlashDrafter(config, rngs=nnx.Rngs(params=seed))


def with_draft_vocabulary(drafter: DFlashDrafter, ids) -> DFlashDrafter:
    """FR-Spec for a DFlash drafter: a new drafter over the same weights that drafts only the target ids
    `ids` (1-D, sorted, unique; e.g. the most frequent ids of a corpus), ranking them with the target's LM
    head restricted to them. Training-free and lossless; applied at run time (z-lab's layout has no place
    for it: save_dflash refuses such a drafter)."""
    return with_draft_ids(drafter, ids, drafter.config.layer.vocab_size)


def drafter_to_decoding_layout(drafter: DFlashDrafter, model_shards: int = 1) -> DFlashDrafter:
    """The drafter with its layers in the decoding layout (see transformer.to_decoding_layout)."""
    if not isinstance(drafter.layers, StackedLayers):
        return drafter
    c = drafter.config.layer
    split = jax.tree.map(lambda w: w, drafter)
    split.layers = nnx.List([DecodingLayer(drafter.layers, i, c, model_shards) for i in range(c.num_layers)])
    return split


# ---------------------------------------------------------------------------------- the z-lab layout

def tensor_rules(config: DFlashConfig) -> list[hf.Rule]:
    return [hf.transposed("fc", "fc.weight"), hf.same("hidden_norm", "hidden_norm.weight"),
            hf.same("final_norm", "norm.weight"), *hf.decoder_layer_rules(config.layer, "layers.{i}.")]


def config_from_hf(raw: dict, path: Path = Path(hf.CONFIG_FILE)) -> DFlashConfig:
    """A DFlash config.json (z-lab's layout) as a DFlashConfig (dtypes float32; `load_dflash` sets them)."""
    architectures = raw.get("architectures") or []
    if architectures[:1] != [ARCHITECTURE]:
        raise hf.CheckpointError(f"{path}: architectures {architectures} is not a DFlash drafter: allowed "
                                 f"[{ARCHITECTURE!r}]")
    layer = hf.config_from_hf({**raw, "architectures": ["Qwen3ForCausalLM"]}, path)
    options = {**raw, **(raw.get("dflash_config") or {})}  # dflash_config wins, as in vLLM
    for name in ("target_layer_ids", "mask_token_id"):
        if options.get(name) is None:
            raise hf.CheckpointError(f"{path}: field dflash_config.{name} is missing; a DFlash drafter needs it")
    try:
        return DFlashConfig(layer=layer, target_layer_ids=tuple(int(i) for i in options["target_layer_ids"]),
                            mask_token_id=int(options["mask_token_id"]),
                            block_size=int(options.get("block_size", 16)),
                            causal=bool(options.get("causal", raw.get("is_causal") or False)),
                            num_target_layers=int(options.get("num_target_layers",
                                                              max(options["target_layer_ids"]) + 1)))
    except ValueError as error:
        raise hf.CheckpointError(f"{path}: {error}") from error


def config_to_hf(config: DFlashConfig) -> dict:
    """The config.json z-lab's model code (and vLLM) read back as the same drafter."""
    raw = hf.config_to_hf(config.layer)
    options = {"target_layer_ids": list(config.target_layer_ids), "mask_token_id": config.mask_token_id,
               "block_size": config.block_size, "causal": config.causal}
    return {**raw, "architectures": [ARCHITECTURE], "block_size": config.block_size,
            "num_target_layers": config.num_target_layers, "is_causal": config.causal, "dflash_config": options}


def load_dflash(folder: str | Path, target_config: ModelConfig | None = None, dtype: str | None = None) -> DFlashDrafter:
    """A DFlash drafter from a folder in z-lab's layout. target_config, when given, is checked: equal
    hidden size and vocabulary, and target_layer_ids inside its depth. dtype: the compute and storage
    dtype (default: the checkpoint's)."""
    return load_block_drafter(folder, config_from_hf, DFlashDrafter, tensor_rules, "a DFlash drafter", target_config,
                              dtype)


def load_block_drafter(folder: str | Path, read_config, module_class, rules, kind: str,
                       target_config: ModelConfig | None = None, dtype: str | None = None, ignored=()):
    """A drafter built on DFlash's backbone from its folder: read_config(raw, path) makes its config,
    module_class(config, rngs=...) the module, rules(config) its tensor table; tensors named in `ignored`
    may be present and are not read (copies of the target's that the drafter takes from the target)."""
    folder = Path(folder)
    config = read_config(hf.read_config_json(folder, f" (is this {kind} folder?)"), folder / hf.CONFIG_FILE)
    reader = hf.TensorReader(folder)
    param_dtype = reader.param_dtype(dtype)
    layer = dataclasses.replace(config.layer, param_dtype=param_dtype, dtype=param_dtype)
    config = dataclasses.replace(config, layer=layer)
    if target_config is not None:
        check_target(config, target_config)
    drafter = nnx.eval_shape(lambda: module_class(config, rngs=nnx.Rngs(0)))
    used = hf.fill_from_rules(drafter, rules(config), reader, folder, layer.num_layers, kind)
    hf.check_all_used(reader, used | (reader.keys() & set(ignored)), folder, kind)
    return drafter


def save_dflash(drafter: DFlashDrafter, folder: str | Path) -> None:
    """Writes the drafter in z-lab's layout (stacked layers only, as hf.save)."""
    save_block_drafter(drafter, folder, config_to_hf(drafter.config), tensor_rules(drafter.config))


def save_block_drafter(drafter: DFlashDrafter, folder: str | Path, raw: dict, rules: list[hf.Rule]) -> None:
    """Writes a drafter built on DFlash's backbone: config.json `raw` (with its dtype) and the tensors of `rules`."""
    if not isinstance(drafter.layers, StackedLayers):
        raise ValueError("the drafter's layers are in the decoding layout, which is not a checkpoint layout: "
                         "save the stacked drafter it was made from")
    if drafter.draft_to_target is not None:
        raise ValueError("the drafter has a draft vocabulary (with_draft_vocabulary), which z-lab's layout cannot "
                         "hold: save the drafter it was made from and apply the vocabulary at run time")
    config = drafter.config
    raw = {**raw, "dtype": config.layer.param_dtype if config.layer.param_dtype in hf.CHECKPOINT_DTYPES else "float32"}
    hf.write_from_rules(drafter, rules, folder, raw, num_layers=config.layer.num_layers)


def check_target(config: DFlashConfig, target_config: ModelConfig) -> None:
    """Raises ValueError naming the field if the drafter cannot read this target."""
    for field in ("hidden_size", "vocab_size"):
        ours, theirs = getattr(config.layer, field), getattr(target_config, field)
        if ours != theirs:
            raise ValueError(f"DFlash drafter {field} {ours} differs from the target's {theirs}: allowed only equal")
    if config.num_target_layers != target_config.num_layers:
        raise ValueError(f"DFlash drafter num_target_layers {config.num_target_layers} differs from the target's "
                         f"num_layers {target_config.num_layers}: allowed only equal")


"""EAGLE draft heads (Li et al.): one decoder layer that extrapolates the target's features.

EAGLE-1: the input of position j is fc([embed(x_{j+1}), f_j]) (2H -> H, with bias), where f_j is the
target's final-norm feature at j and x_{j+1} the token after it (the token stream runs one step ahead
of the features); one Llama decoder layer, whose attention reads that input directly (its first
input norm is skipped), predicts f_{j+1}; the target's own LM head turns it into draft logits.

EAGLE-3: the feature is fused from the hidden states entering three target layers (default 2, L//2,
L-3) through fc (3H -> H, no bias); the layer's attention reads [norm(embed), norm(feature)] (2H) and
its residual stream starts from the feature; its own final norm and LM head give logits over a draft
vocabulary (possibly reduced), mapped to target ids by `draft_to_target`. Drafting steps after the
first feed the layer's own output back as the feature.

Both keep their own one-layer KV cache. Loading reads the public checkpoint layouts (safetensors):
EAGLE-1 `fc.*`, `layers.0.*`; EAGLE-3 `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`,
`d2t` (target id = draft id + d2t[draft id]).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from specjax.config import ConfigError, ModelConfig
from specjax.models import hf
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import (DecoderLayers, DecodingLayer, Hidden, _param, decoder_layer, einsum_f32,
                                        normalize, query_slots_for)


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """layer: the decoder layer's shape (num_layers 1; hidden_size and vocab_size are the target's).
    version: 1 or 3. fuse_layers (EAGLE-3): target layers whose inputs are fused. draft_vocab_size
    (EAGLE-3): size of the head's own vocabulary, the target's when None."""

    layer: ModelConfig
    version: int = 1
    fuse_layers: tuple[int, ...] = ()
    draft_vocab_size: int | None = None

    def __post_init__(self):
        if self.version not in (1, 3):
            raise ConfigError(f"EagleConfig.version = {self.version!r} is invalid: allowed 1 or 3")
        if self.layer.num_layers != 1:
            raise ConfigError(f"EagleConfig.layer.num_layers = {self.layer.num_layers} is invalid: allowed 1")
        if self.version == 3 and len(self.fuse_layers) != 3:
            raise ConfigError(f"EagleConfig.fuse_layers = {self.fuse_layers!r} is invalid: EAGLE-3 fuses 3 layers")
        if self.version == 1 and (self.fuse_layers or self.draft_vocab_size):
            raise ConfigError("EagleConfig: fuse_layers and draft_vocab_size are EAGLE-3 settings: allowed only "
                              "with version 3")

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.layer.vocab_size


def default_fuse_layers(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice: the inputs of layers 2, L // 2 and L - 3."""
    if num_target_layers < 5:
        raise ConfigError(f"default EAGLE-3 fuse layers need a target of >= 5 layers, got {num_target_layers}: "
                          "give fuse_layers explicitly")
    return (2, num_target_layers // 2, num_target_layers - 3)


class EagleHead(nnx.Module):
    def __init__(self, config: EagleConfig, *, rngs: nnx.Rngs):
        self.config = config
        c, D = config.layer, config.layer.hidden_size
        if config.version == 1:
            self.fc, self.fc_bias = _param(rngs, (2 * D, D), c), _param(rngs, (D,), c, "zeros")
            self.layer = DecoderLayers(c, rngs=rngs)
            self.layer.attn_norm = None  # EAGLE-1's layer reads the fc output without a norm
            self.embed_norm = self.final_norm = self.lm_head = self.draft_to_target = None
        else:
            self.fc, self.fc_bias = _param(rngs, (3 * D, D), c), None
            self.layer = DecoderLayers(c, rngs=rngs, attn_input_size=2 * D)
            self.embed_norm = _param(rngs, (D,), c, "ones")  # the layer's attn_norm normalises the feature
            self.final_norm = _param(rngs, (D,), c, "ones")
            self.lm_head = _param(rngs, (D, config.draft_vocab), c)
            self.draft_to_target = nnx.Variable(jnp.arange(config.draft_vocab, dtype=jnp.int32))

    def fuse(self, target_hidden: Hidden) -> Float[Array, "B T D"]:
        """The feature each target position hands the head."""
        if self.config.version == 1:
            return target_hidden.final
        stacked = target_hidden.layers  # [3, B, T, D], in fuse_layers order
        fused = jnp.concatenate([stacked[0], stacked[1], stacked[2]], axis=-1)
        dtype = self.config.layer.jnp_dtype
        return jnp.einsum("btf,fd->btd", fused.astype(dtype), self.fc[...].astype(dtype))

    def __call__(self, tokens: Int[Array, "B T"], features: Float[Array, "B T D"], positions: Int[Array, "B T"],
                 cache: KVCache, embed: Float[Array, "V D"]) -> tuple[Float[Array, "B T D"], KVCache]:
        """Runs the pairs (features[:, t], tokens[:, t]) at slots after the cache's fill level and
        returns the predicted next features; the cache comes back with lengths + T."""
        c = self.config.layer
        dtype = c.jnp_dtype
        embedded = embed[tokens].astype(dtype)
        features = features.astype(dtype)
        layer = self.layer if isinstance(self.layer, DecodingLayer) else jax.tree.map(lambda w: w[0], self.layer)
        slots = query_slots_for(tokens.shape[0], tokens.shape[1], cache)
        if self.config.version == 1:
            x = jnp.einsum("btf,fd->btd", jnp.concatenate([embedded, features], -1), self.fc[...].astype(dtype))
            x = x + self.fc_bias[...].astype(dtype)
            out, cache = decoder_layer(x, layer, 0, positions, slots, cache, c, attn_input=x)
        else:
            attn_input = jnp.concatenate([normalize(embedded, self.embed_norm[...], None, c),
                                          normalize(features, layer.attn_norm[...], None, c)], -1)
            out, cache = decoder_layer(features, layer, 0, positions, slots, cache, c, attn_input=attn_input)
        return out, cache.with_lengths(cache.lengths + tokens.shape[1])

    def create_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """An empty KV cache for the head's layer, laid out for it (see Transformer.create_cache)."""
        return KVCache.create(self.config.layer, batch_size, max_length, dtype,
                              per_layer=isinstance(self.layer, DecodingLayer))

    def logits(self, features: Float[Array, "... D"], target_lm_head) -> Float[Array, "... V"]:
        """Float32 logits over the target's vocabulary. target_lm_head(features) -> logits is the
        target's unembedding (EAGLE-1); EAGLE-3 uses its own head and maps draft ids to target ids,
        leaving every other target id at -inf."""
        if self.config.version == 1:
            return target_lm_head(features)
        c = self.config.layer
        normed = normalize(features.astype(c.jnp_dtype), self.final_norm[...], None, c)
        draft = einsum_f32("...d,dv->...v", normed, self.lm_head[...].astype(c.jnp_dtype))
        full = jnp.full((*draft.shape[:-1], c.vocab_size), -jnp.inf, jnp.float32)
        return full.at[..., self.draft_to_target[...]].set(draft)


def init_eagle(config: EagleConfig, seed: int = 0) -> EagleHead:
    return EagleHead(config, rngs=nnx.Rngs(params=seed))


def split_head(head: EagleHead, model_shards: int = 1) -> EagleHead:
    """The head with its layer in the decoding layout (transformer.DecodingLayer: q/k/v and gate/up
    fused, shard-major for model_shards): a draft step reads the layer's weights in four products
    instead of seven. Training and checkpoints keep the stacked layer; a split head is returned as is."""
    if isinstance(head.layer, DecodingLayer):
        return head
    split = jax.tree.map(lambda w: w, head)  # a new module over the same arrays
    split.layer = DecodingLayer(head.layer, 0, head.config.layer, model_shards)
    return split


# ------------------------------------------------------------------------------ public checkpoints

def _layer_rules(config: EagleConfig, prefix: str) -> list[hf.Rule]:
    c = config.layer
    D, H, K, E, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    d_in = D if config.version == 1 else 2 * D
    per_layer = [
        hf._in_proj("layer.wq", prefix + "self_attn.q_proj.weight", d_in, H, E),
        hf._in_proj("layer.wk", prefix + "self_attn.k_proj.weight", d_in, K, E),
        hf._in_proj("layer.wv", prefix + "self_attn.v_proj.weight", d_in, K, E),
        hf._out_proj("layer.wo", prefix + "self_attn.o_proj.weight", D, H, E),
        hf._in_proj("layer.w_gate", prefix + "mlp.gate_proj.weight", D, F),
        hf._in_proj("layer.w_up", prefix + "mlp.up_proj.weight", D, F),
        hf._out_proj("layer.w_down", prefix + "mlp.down_proj.weight", D, F),
        hf._same("layer.mlp_norm", prefix + "post_attention_layernorm.weight"),
    ]
    if config.version == 3:  # the layer's attn_norm normalises the feature; embed_norm the embedding
        per_layer.append(hf._same("layer.attn_norm", prefix + "hidden_norm.weight"))
    # The head's one layer keeps DecoderLayers' leading layer axis (of size 1).
    rules = [dataclasses.replace(rule, layered=True) for rule in per_layer]
    if config.version == 3:
        rules.append(hf._same("embed_norm", prefix + "input_layernorm.weight"))
    return rules


def _rules(config: EagleConfig) -> list[hf.Rule]:
    transpose = lambda w: (w.T,)  # noqa: E731  (torch Linear [out, in] <-> ours [in, out])
    if config.version == 1:
        return [hf.Rule(("fc",), ("fc.weight",), transpose, transpose), hf._same("fc_bias", "fc.bias"),
                *_layer_rules(config, "layers.0.")]
    return [hf.Rule(("fc",), ("fc.weight",), transpose, transpose), hf._same("final_norm", "norm.weight"),
            hf.Rule(("lm_head",), ("lm_head.weight",), transpose, transpose), *_layer_rules(config, "midlayer.")]


def load_eagle(folder: str | Path, target_config: ModelConfig, *, version: int | None = None,
               fuse_layers: tuple[int, ...] | None = None) -> EagleHead:
    """Loads an EAGLE-1 or EAGLE-3 checkpoint folder (config.json + model.safetensors) in the public
    layout. version defaults to 3 when the config names a draft vocabulary or the weights a midlayer."""
    folder = Path(folder)
    config_path = folder / hf.CONFIG_FILE
    if not config_path.exists():
        raise hf.CheckpointError(f"{folder}: no {hf.CONFIG_FILE} found")
    raw = json.loads(config_path.read_text())
    reader = hf._TensorReader(folder)
    if version is None:
        version = 3 if ("draft_vocab_size" in raw or "fc.weight" in reader.keys()
                        and "midlayer.self_attn.q_proj.weight" in reader.keys()) else 1
    layer_raw = {**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                 "vocab_size": target_config.vocab_size}
    layer = dataclasses.replace(hf.config_from_hf(layer_raw, config_path), param_dtype=target_config.param_dtype,
                                dtype=target_config.dtype)
    draft_vocab = raw.get("draft_vocab_size") if version == 3 else None
    if version == 3 and fuse_layers is None:
        fuse_layers = default_fuse_layers(target_config.num_layers)
    config = EagleConfig(layer=layer, version=version, fuse_layers=tuple(fuse_layers or ()),
                         draft_vocab_size=draft_vocab if draft_vocab != target_config.vocab_size else None)
    head = nnx.eval_shape(lambda: init_eagle(config))
    if version == 3:  # target id = draft id + d2t[draft id]; no d2t means the draft vocabulary is the target's
        offsets = np.asarray(reader.get("d2t")) if "d2t" in reader.keys() else np.zeros(config.draft_vocab, np.int64)
        head.draft_to_target.set_value(jnp.asarray(np.arange(config.draft_vocab) + offsets, jnp.int32))
    used = hf.fill_from_rules(head, _rules(config), reader, folder, 1, f"EAGLE-{version}")
    # EAGLE checkpoints may carry a copy of the target's embedding; the head uses the target's own.
    hf.check_all_used(reader, used | {"d2t", "t2d", "embed_tokens.weight"}, folder, f"EAGLE-{version}")
    return head


def save_eagle(head: EagleHead, folder: str | Path) -> None:
    """Writes the public layout that load_eagle reads."""
    if isinstance(head.layer, DecodingLayer):
        raise ValueError("head.layer is in the decoding layout (eagle.split_head), which is not a checkpoint "
                         "layout: save the head it was made from")
    folder = Path(folder)
    config = head.config
    raw = hf.config_to_hf(config.layer)
    raw["num_hidden_layers"] = 1
    if config.version == 3:
        raw["draft_vocab_size"] = config.draft_vocab
    extra = {}
    if config.version == 3:
        ids = np.asarray(head.draft_to_target[...])
        extra["d2t"] = jnp.asarray(ids - np.arange(len(ids)), jnp.int32)
    hf.write_from_rules(head, _rules(config), folder, raw, extra)

"""EAGLE draft heads (Li et al.): one decoder layer that extrapolates the target's features.

EAGLE-1: the input of position j is fc([embed(x_{j+1}), f_j]) (2H -> H, with bias), where f_j is the
target's final-norm feature at j and x_{j+1} the token after it (the token stream runs one step ahead
of the features); one Llama decoder layer, whose attention reads that input directly (its first
input norm is skipped), predicts f_{j+1}; the target's own LM head turns it into draft logits.
With a draft vocabulary (FR-Spec, Zhao et al. 2025: the most frequent target ids), only those rows of
the target's unembedding are used (gathered once per generate call by the proposer), so a draft step
reads a fraction of the LM-head bytes; the head's weights are the same and the target still verifies over
its whole vocabulary (`with_draft_vocabulary` applies it to a trained head).

EAGLE-3: the feature is fused from the hidden states entering three target layers (default 2, L//2,
L-3) through fc (3H -> H, no bias); the layer's attention reads [norm(embed), norm(feature)] (2H) and
its residual stream starts from the feature; its own final norm and LM head give logits over a draft
vocabulary (possibly reduced), mapped to target ids by `draft_to_target`. Drafting steps after the
first feed the layer's own output back as the feature.

Both keep their own one-layer KV cache. Loading reads the public checkpoint layouts (safetensors):
EAGLE-1 `fc.*`, `layers.0.*`; EAGLE-3 `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`,
`d2t` (target id = draft id + d2t[draft id]). An EAGLE-1 head with a draft vocabulary also writes
`draft_vocab_size` (config.json) and `d2t`, an extension of the public EAGLE-1 layout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from specjax.config import ConfigError, ModelConfig
from specjax.models import hf
from specjax.models.kv_cache import KVCache
from specjax.models.vocabulary import to_target_vocabulary, with_draft_ids
from specjax.models.transformer import (StackedLayers, DecodingLayer, Hidden, at_model_precision, checkpointed,
                                        init_param, decoder_layer, einsum_f32, normalize, query_slots_for)


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """layer: the decoder layer's shape (num_layers 1; hidden_size and vocab_size are the target's).
    version: 1 or 3. fuse_layers (EAGLE-3): target layers whose inputs are fused. draft_vocab_size:
    how many target ids drafts are drawn from (the head's `draft_to_target`), the target's whole
    vocabulary when None; for EAGLE-3 the size of its own LM head, for EAGLE-1 the rows of the
    target's unembedding it drafts with (FR-Spec)."""

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
        if self.version == 1 and self.fuse_layers:
            raise ConfigError(f"EagleConfig.fuse_layers = {self.fuse_layers!r} is invalid with version 1: fuse_layers "
                              "is an EAGLE-3 setting, allowed only with version 3")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.layer.vocab_size:
            raise ConfigError(f"EagleConfig.draft_vocab_size = {self.draft_vocab_size!r} is invalid: allowed None or "
                              f"an integer in 1..{self.layer.vocab_size} (the target's vocab_size)")

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.layer.vocab_size


def default_fuse_layers(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice, the inputs of layers 2, L // 2 and L - 3, where those are distinct (L >= 7); on
    smaller targets, where that rule repeats a layer (L = 6: 2, 3, 3), layers 1, L // 2 and L - 1."""
    if num_target_layers >= 7:
        return (2, num_target_layers // 2, num_target_layers - 3)
    if num_target_layers < 4:
        raise ConfigError(f"default EAGLE-3 fuse layers need a target of >= 4 layers (3 distinct layers), got "
                          f"{num_target_layers}: give fuse_layers explicitly")
    return (1, num_target_layers // 2, num_target_layers - 1)


# config.json's record of the fused layers (SpecForge's and vLLM's EAGLE-3 key), so that a head keeps its
# layers whatever default_fuse_layers says when it is loaded.
FUSE_LAYERS_KEY = ("eagle_config", "eagle_aux_hidden_state_layer_ids")


class EagleHead(nnx.Module):
    def __init__(self, config: EagleConfig, *, rngs: nnx.Rngs):
        self.config = config
        c, D = config.layer, config.layer.hidden_size
        if config.version == 1:
            self.fc, self.fc_bias = init_param(rngs, (2 * D, D), c), init_param(rngs, (D,), c, "zeros")
            self.layer = StackedLayers(c, rngs=rngs)
            self.layer.attn_norm = None  # EAGLE-1's layer reads the fc output without a norm
            self.embed_norm = self.final_norm = self.lm_head = None
            # FR-Spec: the target ids drafted from; its logits come from those rows of the target's unembedding.
            self.draft_to_target = None if config.draft_vocab_size is None else \
                nnx.Variable(jnp.arange(config.draft_vocab, dtype=jnp.int32))
        else:
            self.fc, self.fc_bias = init_param(rngs, (3 * D, D), c), None
            self.layer = StackedLayers(c, rngs=rngs, attn_input_size=2 * D)
            self.embed_norm = init_param(rngs, (D,), c, "ones")  # the layer's attn_norm normalises the feature
            self.final_norm = init_param(rngs, (D,), c, "ones")
            self.lm_head = init_param(rngs, (D, config.draft_vocab), c)
            self.draft_to_target = nnx.Variable(jnp.arange(config.draft_vocab, dtype=jnp.int32))

    @at_model_precision
    def fuse(self, target_hidden: Hidden) -> Float[Array, "B T D"]:
        """The feature each target position hands the head."""
        if self.config.version == 1:
            return target_hidden.final
        stacked = target_hidden.layers  # [3, B, T, D], in fuse_layers order
        fused = jnp.concatenate([stacked[0], stacked[1], stacked[2]], axis=-1)
        dtype = self.config.layer.jnp_dtype
        return jnp.einsum("btf,fd->btd", fused.astype(dtype), self.fc[...].astype(dtype))

    @at_model_precision
    def __call__(self, tokens: Int[Array, "B T"], features: Float[Array, "B T D"], positions: Int[Array, "B T"],
                 cache: KVCache | None, embed: Float[Array, "V D"],
                 attention_mask: Bool[Array, "B T S"] | None = None) -> tuple[Float[Array, "B T D"], KVCache | None]:
        """Runs the pairs (features[:, t], tokens[:, t]) at slots after the cache's fill level and
        returns the predicted next features; the cache comes back with lengths + T. attention_mask:
        which cache slots each pair sees (a draft tree's), in place of the causal rule. cache None
        (training): the pairs attend causally among themselves through the full forward's attention
        (jax.nn.dot_product_attention, cuDNN's flash attention on GPUs), as a fresh cache would."""
        c = self.config.layer
        dtype = c.jnp_dtype
        embedded = embed[tokens].astype(dtype)
        features = features.astype(dtype)
        layer = self.layer if isinstance(self.layer, DecodingLayer) else jax.tree.map(lambda w: w[0], self.layer)
        slots = query_slots_for(tokens.shape[0], tokens.shape[1], cache)

        def run_layer(x, attn_input, layer, cache):  # rematerialised in training by c.remat
            return decoder_layer(x, layer, 0, positions, slots, cache, c, attn_input=attn_input, visible=attention_mask)

        if self.config.version == 1:
            x = jnp.einsum("btf,fd->btd", jnp.concatenate([embedded, features], -1), self.fc[...].astype(dtype))
            x = x + self.fc_bias[...].astype(dtype)
            out, cache = checkpointed(run_layer, c)(x, x, layer, cache)
        else:
            attn_input = jnp.concatenate([normalize(embedded, self.embed_norm[...], None, c),
                                          normalize(features, layer.attn_norm[...], None, c)], -1)
            out, cache = checkpointed(run_layer, c)(features, attn_input, layer, cache)
        return out, None if cache is None else cache.with_lengths(cache.lengths + tokens.shape[1])

    def create_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """An empty KV cache for the head's layer, laid out for it (see Transformer.create_cache)."""
        return KVCache.create(self.config.layer, batch_size, max_length, dtype,
                              per_layer=isinstance(self.layer, DecodingLayer))

    def logits(self, features: Float[Array, "... D"], target_lm_head) -> Float[Array, "... V"]:
        """Float32 logits over the target's vocabulary. target_lm_head(features) -> logits is the
        target's unembedding, which an EAGLE-1 head uses. EAGLE-3 with a draft vocabulary: the logits of
        the draft ids come from its own [D, V_draft] head (after its final norm) and land at their target
        ids (draft_to_target); every other target id is -inf."""
        draft, ids = self.draft_logits(features, target_lm_head)
        return draft if ids is None else to_target_vocabulary(draft, ids, self.config.layer.vocab_size)

    @at_model_precision
    def draft_logits(self, features: Float[Array, "... D"], target_lm_head
                     ) -> tuple[Float[Array, "... Vd"], Int[Array, " Vd"] | None]:
        """(logits over the draft vocabulary, its target ids draft_to_target), or (`logits`, None) for a
        head without one: what ranks drafts without the scatter to the target's vocabulary. An EAGLE-1
        head with one drafts through the target's rows, which its bound params hold
        (specjax.proposers.drafting.TargetHeadParams, FR-Spec)."""
        c = self.config.layer
        if self.draft_to_target is None:
            return target_lm_head(features), None
        if self.config.version == 1:
            raise ValueError("an EAGLE-1 head with a draft vocabulary drafts through the target's unembedding "
                             "restricted to it: allowed through EagleProposer.draft_logits (its bound params)")
        x = normalize(features.astype(c.jnp_dtype), self.final_norm[...], None, c)
        return einsum_f32("...d,dv->...v", x, self.lm_head[...].astype(c.jnp_dtype)), self.draft_to_target[...]


def init_eagle(config: EagleConfig, seed: int = 0) -> EagleHead:
    return EagleHead(config, rngs=nnx.Rngs(params=seed))


def head_to_decoding_layout(head: EagleHead, model_shards: int = 1) -> EagleHead:
    """The head with its layer in the decoding layout (transformer.DecodingLayer: q/k/v and gate/up
    fused, shard-major for model_shards): a draft step reads the layer's weights in four products
    instead of seven. Training and checkpoints keep the stacked layer; a split head is returned as is."""
    if isinstance(head.layer, DecodingLayer):
        return head
    split = jax.tree.map(lambda w: w, head)  # a new module over the same arrays
    split.layer = DecodingLayer(head.layer, 0, head.config.layer, model_shards)
    return split


def with_draft_vocabulary(head: EagleHead, ids) -> EagleHead:
    """FR-Spec (Zhao et al. 2025) for a trained EAGLE-1 head: a new head over the same weights that drafts
    only the target ids `ids` (1-D, sorted, unique; e.g. the most frequent ids of a corpus,
    specjax.models.vocabulary.draft_vocabulary). Training-free and lossless: the target verifies over its
    whole vocabulary. The head given is unchanged; a head with a draft vocabulary gets the new one."""
    if head.config.version != 1:
        raise ValueError(f"with_draft_vocabulary: got an EAGLE-{head.config.version} head, whose own LM head is "
                         "trained over its draft vocabulary: allowed only EAGLE-1 heads")
    reduced = with_draft_ids(head, ids, head.config.layer.vocab_size)
    reduced.config = dataclasses.replace(head.config, draft_vocab_size=reduced.draft_to_target.shape[0])
    return reduced


# ------------------------------------------------------------------------------ public checkpoints

def _layer_rules(config: EagleConfig, prefix: str) -> list[hf.Rule]:
    c = config.layer
    D, H, K, E, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    d_in = D if config.version == 1 else 2 * D
    per_layer = [
        hf.in_proj("layer.wq", prefix + "self_attn.q_proj.weight", d_in, H, E),
        hf.in_proj("layer.wk", prefix + "self_attn.k_proj.weight", d_in, K, E),
        hf.in_proj("layer.wv", prefix + "self_attn.v_proj.weight", d_in, K, E),
        hf.out_proj("layer.wo", prefix + "self_attn.o_proj.weight", D, H, E),
        hf.in_proj("layer.w_gate", prefix + "mlp.gate_proj.weight", D, F),
        hf.in_proj("layer.w_up", prefix + "mlp.up_proj.weight", D, F),
        hf.out_proj("layer.w_down", prefix + "mlp.down_proj.weight", D, F),
        hf.same("layer.mlp_norm", prefix + "post_attention_layernorm.weight"),
    ]
    if config.version == 3:  # the layer's attn_norm normalises the feature; embed_norm the embedding
        per_layer.append(hf.same("layer.attn_norm", prefix + "hidden_norm.weight"))
    # The head's one layer keeps StackedLayers' leading layer axis (of size 1).
    rules = [dataclasses.replace(rule, layered=True) for rule in per_layer]
    if config.version == 3:
        rules.append(hf.same("embed_norm", prefix + "input_layernorm.weight"))
    return rules


def _rules(config: EagleConfig) -> list[hf.Rule]:
    transpose = lambda w: (w.T,)  # noqa: E731  (torch Linear [out, in] <-> ours [in, out])
    if config.version == 1:
        return [hf.Rule(("fc",), ("fc.weight",), transpose, transpose), hf.same("fc_bias", "fc.bias"),
                *_layer_rules(config, "layers.0.")]
    return [hf.Rule(("fc",), ("fc.weight",), transpose, transpose), hf.same("final_norm", "norm.weight"),
            hf.Rule(("lm_head",), ("lm_head.weight",), transpose, transpose), *_layer_rules(config, "midlayer.")]


def load_eagle(folder: str | Path, target_config: ModelConfig, *, version: int | None = None,
               fuse_layers: tuple[int, ...] | None = None) -> EagleHead:
    """Loads an EAGLE-1 or EAGLE-3 checkpoint folder (config.json + model.safetensors) in the public
    layout. version defaults to what the weights say: 3 with `midlayer.*`, 1 with `layers.0.*`. Either
    version reads a draft vocabulary (config.json `draft_vocab_size`, tensor `d2t`). EAGLE-3's fuse_layers
    default to config.json's eagle_config.eagle_aux_hidden_state_layer_ids, else default_fuse_layers.
    Repeated layers load (heads trained before the rule); only new training configs refuse them."""
    folder = Path(folder)
    raw = hf.read_config_json(folder)
    reader = hf.TensorReader(folder)
    if version is None:
        version = _checkpoint_version(reader.keys(), folder)
    layer_raw = {**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                 "vocab_size": target_config.vocab_size}
    layer = dataclasses.replace(hf.config_from_hf(layer_raw, folder / hf.CONFIG_FILE), param_dtype=target_config.param_dtype,
                                dtype=target_config.dtype)
    draft_vocab = raw.get("draft_vocab_size")
    if version == 3 and fuse_layers is None:
        recorded = raw.get(FUSE_LAYERS_KEY[0], {}).get(FUSE_LAYERS_KEY[1])
        fuse_layers = tuple(recorded) if recorded is not None else default_fuse_layers(target_config.num_layers)
    config = EagleConfig(layer=layer, version=version, fuse_layers=tuple(fuse_layers or ()),
                         draft_vocab_size=draft_vocab if draft_vocab != target_config.vocab_size else None)
    head = nnx.eval_shape(lambda: init_eagle(config))
    if head.draft_to_target is not None:  # target id = draft id + d2t[draft id]; no d2t: the first ids
        offsets = np.asarray(reader.get("d2t")) if "d2t" in reader.keys() else np.zeros(config.draft_vocab, np.int64)
        if offsets.shape != (config.draft_vocab,):
            raise hf.CheckpointError(f"{folder}: 'd2t' has shape {offsets.shape}; expected ({config.draft_vocab},), "
                                     "one offset per draft id (config.json draft_vocab_size)")
        head.draft_to_target.set_value(jnp.asarray(np.arange(config.draft_vocab) + offsets, jnp.int32))
    used = hf.fill_from_rules(head, _rules(config), reader, folder, 1, f"EAGLE-{version}")
    # EAGLE checkpoints may carry a copy of the target's embedding; the head uses the target's own.
    hf.check_all_used(reader, used | {"d2t", "t2d", "embed_tokens.weight"}, folder, f"EAGLE-{version}")
    return head


def save_eagle(head: EagleHead, folder: str | Path) -> None:
    """Writes the public layout that load_eagle reads."""
    if isinstance(head.layer, DecodingLayer):
        raise ValueError("head.layer is in the decoding layout (eagle.head_to_decoding_layout), which is not a checkpoint "
                         "layout: save the head it was made from")
    folder = Path(folder)
    config = head.config
    raw = hf.config_to_hf(config.layer)
    raw["num_hidden_layers"] = 1
    if config.version == 3:
        raw[FUSE_LAYERS_KEY[0]] = {FUSE_LAYERS_KEY[1]: list(config.fuse_layers)}
    extra = {}
    if head.draft_to_target is not None:  # EAGLE-3, and EAGLE-1 with a draft vocabulary
        raw["draft_vocab_size"] = config.draft_vocab
        ids = np.asarray(head.draft_to_target[...])
        extra["d2t"] = jnp.asarray(ids - np.arange(len(ids)), jnp.int32)
    hf.write_from_rules(head, _rules(config), folder, raw, extra)


def checkpoint_version(keys) -> int | None:
    """The EAGLE version tensor names are laid out for: 3 with `midlayer.*`, 1 with `fc.bias` and `layers.0.*`
    (a draft LM's are `model.layers.0.*`; a DFlash drafter's fc has no bias), None for neither."""
    if any(key.startswith("midlayer.") for key in keys):
        return 3
    if "fc.bias" in keys and any(key.startswith("layers.0.") for key in keys):
        return 1
    return None


def _checkpoint_version(keys, folder: Path) -> int:
    """checkpoint_version, or a CheckpointError naming the folder."""
    version = checkpoint_version(keys)
    if version is not None:
        return version
    raise hf.CheckpointError(f"{folder}: neither EAGLE-3 weights (midlayer.*) nor EAGLE-1 weights (fc.bias, "
                             "layers.0.*) found: pass version= to load_eagle")

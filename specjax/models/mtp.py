"""Multi-token prediction (MTP) modules trained with the target (DeepSeek-V3, MiMo): module m (0-based) at
position s reads a hidden state for s and the embedding of token x_{s+m+1}, and predicts x_{s+m+2}.

One module, in MiMo's layout (`MiMoMTPLayers` of its `modeling_mimo.py`):
    h = input_proj(concat(hidden_layernorm(g), token_layernorm(embed(x))))     (2D -> D, no bias)
    h = decoder layer (input_layernorm, self_attn, post_attention_layernorm, mlp)
    out = final_layernorm(h)                          -> the target's LM head gives the module's logits
The hidden state g fed to module 0 is the target's final-norm hidden state at s. Module m > 0 reads either
the previous module's output at s ("chained", DeepSeek-V3's depth recursion) or the target's hidden state at
s again ("target": what MiMo was trained with, sglang-jax PR #1256); `MTPConfig.hidden_state` is the
checkpoint's default and SpecConfig.mtp_hidden_state overrides it.

Every module has its own decoder layer and its own KV cache layer, laid out by position s (module m's
entry s holds token x_{s+m+1}); the modules' weights are stacked on a leading module axis (StackedLayers
of num_layers = the number of modules), so module m's cache is layer m of one KVCache.

Checkpoints: MiMo's tensor names `model.mtp_layers.{i}.*` with `num_nextn_predict_layers` in config.json,
either inside the target's own checkpoint (MiMoForCausalLM) or in a folder of their own (specjax's
`default:mtp`); `mtp_hidden_state` in config.json, where present, records the default feeding.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from specjax.config import ConfigError, ModelConfig
from specjax.models import hf
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import (DecodingLayer, StackedLayers, at_model_precision, checkpointed, decoder_layer,
                                        init_param, normalize, query_slots_for)

HIDDEN_STATES = ("chained", "target")
NUM_MODULES_KEY = "num_nextn_predict_layers"
HIDDEN_STATE_KEY = "mtp_hidden_state"
# The feeding a checkpoint without HIDDEN_STATE_KEY was trained with, by architecture (MiMo: the target's
# hidden state at every module, sglang-jax PR #1256); others chain, as DeepSeek-V3's recursion does.
DEFAULT_HIDDEN_STATE = {"MiMoForCausalLM": "target"}


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """layer: the modules' decoder layers (num_layers = the number of modules; hidden_size and vocab_size
    are the target's). hidden_state: what feeds module m > 0, 'chained' or 'target' (module docstring)."""

    layer: ModelConfig
    hidden_state: str = "chained"

    def __post_init__(self):
        if self.hidden_state not in HIDDEN_STATES:
            raise ConfigError(f"MTPConfig.hidden_state = {self.hidden_state!r} is invalid: allowed one of "
                              f"{list(HIDDEN_STATES)}")

    @property
    def num_modules(self) -> int:
        return self.layer.num_layers


class MTPModules(nnx.Module):
    def __init__(self, config: MTPConfig, *, rngs: nnx.Rngs):
        self.config = config
        c, M, D = config.layer, config.num_modules, config.layer.hidden_size
        self.token_norm = init_param(rngs, (M, D), c, "ones")
        self.hidden_norm = init_param(rngs, (M, D), c, "ones")
        self.input_proj = init_param(rngs, (M, 2 * D, D), c)  # input [hidden, embedding] (MiMo's order)
        self.layers: StackedLayers | nnx.List = StackedLayers(c, rngs=rngs)  # nnx.List: the decoding layout
        self.final_norm = init_param(rngs, (M, D), c, "ones")

    def layer(self, module: int):
        """Module `module`'s decoder layer weights."""
        if isinstance(self.layers, StackedLayers):
            return jax.tree.map(lambda w: w[module], self.layers)
        return self.layers[module]

    @at_model_precision
    def __call__(self, module: int, tokens: Int[Array, "B T"], hidden: Float[Array, "B T D"],
                 positions: Int[Array, "B T"], cache: KVCache | None, embed: Float[Array, "V D"],
                 ) -> tuple[Float[Array, "B T D"], KVCache | None]:
        """Module `module` (a static int) over T entries (hidden[:, t], tokens[:, t]) at slots after its cache
        layer's fill level (cache.lengths), or causally among themselves without a cache; returns its
        outputs after its final norm and the cache with lengths + T."""
        c = self.config.layer
        dtype = c.jnp_dtype
        embedded = normalize(embed[tokens].astype(dtype), self.token_norm[...][module], None, c)
        normed = normalize(hidden.astype(dtype), self.hidden_norm[...][module], None, c)
        x = jnp.einsum("btf,fd->btd", jnp.concatenate([normed, embedded], -1),
                       self.input_proj[...][module].astype(dtype))
        slots = query_slots_for(tokens.shape[0], tokens.shape[1], cache)

        def run_layer(x, layer, cache):  # rematerialised in training by c.remat
            return decoder_layer(x, layer, module, positions, slots, cache, c)

        out, cache = checkpointed(run_layer, c)(x, self.layer(module), cache)
        out = normalize(out, self.final_norm[...][module], None, c)
        return out, None if cache is None else cache.with_lengths(cache.lengths + tokens.shape[1])

    def over_sequence(self, tokens: Int[Array, "B T2"], target_hidden: Float[Array, "B T D"],
                      embed: Float[Array, "V D"], hidden_state: str | None = None, cache: KVCache | None = None
                      ) -> tuple[list[Float[Array, "B T D"]], KVCache | None]:
        """Every module over a whole sequence, as they are trained: module m at position s (0 .. T-1, T the
        hidden states' length) reads token x_{s+m+1} of `tokens` (zeros past its end) and the hidden state that
        `hidden_state` (default: the config's) says. Returns each module's outputs [B, T, D] (module m's
        last m + 1 positions read padding) and, given a cache, the cache with every module's T entries
        written from its fill level."""
        hidden_state = hidden_state or self.config.hidden_state
        batch, length = target_hidden.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        outs, previous = [], target_hidden
        for module in range(self.config.num_modules):
            shifted = tokens[:, module + 1:module + 1 + length]
            shifted = jnp.pad(shifted, ((0, 0), (0, length - shifted.shape[1])))
            fed = target_hidden if hidden_state == "target" else previous
            start = None if cache is None else cache.lengths
            out, cache = self(module, shifted, fed, positions, cache, embed)
            cache = None if cache is None else cache.with_lengths(start)
            outs.append(out)
            previous = out
        return outs, None if cache is None else cache.with_lengths(cache.lengths + length)

    def create_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """An empty KV cache, one layer per module (see Transformer.create_cache)."""
        return KVCache.create(self.config.layer, batch_size, max_length, dtype,
                              per_layer=not isinstance(self.layers, StackedLayers))


def init_mtp(config: MTPConfig, seed: int = 0) -> MTPModules:
    return MTPModules(config, rngs=nnx.Rngs(params=seed))


def mtp_to_decoding_layout(modules: MTPModules, model_shards: int = 1) -> MTPModules:
    """The modules with their layers in the decoding layout (transformer.DecodingLayer); training and
    checkpoints keep the stacked layers; modules already split are returned as they are."""
    if not isinstance(modules.layers, StackedLayers):
        return modules
    split = jax.tree.map(lambda w: w, modules)  # a new module over the same arrays
    split.layers = nnx.List([DecodingLayer(modules.layers, i, modules.config.layer, model_shards)
                             for i in range(modules.config.num_modules)])
    return split


# ------------------------------------------------------------------------------------------ checkpoints

def _rules(config: MTPConfig) -> list[hf.Rule]:
    c = config.layer
    prefix = hf.MTP_TENSOR_PREFIX + "{i}."
    rules = [hf.same("token_norm", prefix + "token_layernorm.weight"),
             hf.same("hidden_norm", prefix + "hidden_layernorm.weight"),
             hf.transposed("input_proj", prefix + "input_proj.weight"),
             hf.same("final_norm", prefix + "final_layernorm.weight"),
             *hf.decoder_layer_rules(c, prefix)]
    return [dataclasses.replace(rule, layered=True) for rule in rules]


def layer_config(raw: dict, path: Path) -> ModelConfig:
    """The modules' decoder-layer shape from a MiMo (or Qwen2) config.json: a Qwen2 layer, whatever
    `attention_bias` says (MiMo's Qwen2Attention has q/k/v biases and no output bias)."""
    num_modules = raw.get(NUM_MODULES_KEY) or 0
    if not isinstance(num_modules, int) or num_modules < 1:
        raise hf.CheckpointError(f"{path}: {NUM_MODULES_KEY} = {num_modules!r}: a checkpoint for method 'mtp' needs "
                                 "MTP modules (allowed a positive integer, e.g. a MiMo checkpoint's)")
    return hf.config_from_hf({**raw, "architectures": ["MiMoForCausalLM"], "num_hidden_layers": num_modules}, path)


def num_modules_in(folder: Path) -> int:
    """config.json's num_nextn_predict_layers (0 where absent or unreadable)."""
    value = hf.config_json_or_empty(folder).get(NUM_MODULES_KEY) or 0
    return value if isinstance(value, int) else 0


def load_mtp(folder: str | Path, target_config: ModelConfig) -> MTPModules:
    """The MTP modules of a checkpoint folder in MiMo's layout (the target's own checkpoint or a folder of
    the modules alone), in the target's dtypes."""
    folder = Path(folder)
    raw = hf.read_config_json(folder)
    path = folder / hf.CONFIG_FILE
    layer = dataclasses.replace(layer_config(raw, path), param_dtype=target_config.param_dtype,
                                dtype=target_config.dtype, vocab_size=target_config.vocab_size)
    architecture = (raw.get("architectures") or [None])[0]
    hidden_state = raw.get(HIDDEN_STATE_KEY, DEFAULT_HIDDEN_STATE.get(architecture, "chained"))
    try:
        config = MTPConfig(layer=layer, hidden_state=hidden_state)
    except ConfigError as error:
        raise hf.CheckpointError(f"{path}: {error}") from error
    reader = hf.TensorReader(folder)
    modules = nnx.eval_shape(lambda: init_mtp(config))
    used = hf.fill_from_rules(modules, _rules(config), reader, folder, config.num_modules, "MTP modules")
    hf.check_all_used(reader, used | {key for key in reader.keys() if not key.startswith(hf.MTP_TENSOR_PREFIX)}, folder,
                      "MTP modules")
    return modules


def save_mtp(modules: MTPModules, folder: str | Path, extra_config: dict | None = None) -> None:
    """Writes the modules alone in MiMo's tensor names (config.json: the layer's Qwen2 fields, the number of
    modules, the default feeding); load_mtp reads it back."""
    if not isinstance(modules.layers, StackedLayers):
        raise ValueError("modules.layers is in the decoding layout (mtp.mtp_to_decoding_layout), which is not a "
                         "checkpoint layout: save the modules it was made from")
    config = modules.config
    raw = hf.config_to_hf(config.layer)
    raw.update({"architectures": ["MiMoForCausalLM"], "model_type": "mimo", NUM_MODULES_KEY: config.num_modules,
                HIDDEN_STATE_KEY: config.hidden_state, "num_hidden_layers": 0, **(extra_config or {})})
    hf.write_from_rules(modules, _rules(config), folder, raw, num_layers=config.num_modules)

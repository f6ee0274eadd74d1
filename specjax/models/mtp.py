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

DeepSeek-V3's module (vLLM's `DeepSeekMultiTokenPredictorLayer`) is the same computation with the input
halves the other way round, h = eh_proj(concat(enorm(embed(x)), hnorm(g))), shared_head.norm as the final
norm and shared_head.head (DeepSeek-V3: a copy of the target's LM head) for the logits; chained, its module
m > 0 reads module m - 1's decoder-layer output before shared_head.norm (`MTPConfig.chain_after_final_norm`
False; MiMo's modules return their output after final_layernorm, and that is what chains).

Checkpoints, two layouts (LAYOUTS), `num_nextn_predict_layers` in config.json either way:
- "mimo": `model.mtp_layers.{i}.*`, inside the target's own checkpoint (MiMoForCausalLM) or in a folder of
  their own (specjax's `default:mtp`);
- "deepseek_v3": `model.layers.{num_hidden_layers + i}.{enorm, hnorm, eh_proj, shared_head.norm,
  shared_head.head, embed_tokens}` and the decoder layer's own tensors, where that layer is one specjax has
  (a Llama-family dense layer: DeepSeek-V3's own MLA attention and MoE MLP are refused, naming the field or
  tensor). embed_tokens and shared_head.head are copies of the target's embedding and LM head, which the
  modules use; given the target's, load_mtp checks the copies equal them.
`mtp_hidden_state` and `mtp_chain_after_final_norm` in config.json, where present, record the defaults.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from specjax.config import ConfigError, ModelConfig
from specjax.models import hf
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import (DecodingLayer, StackedLayers, at_model_precision, checkpointed, decoder_layer,
                                        init_param, normalize, query_slots_for)

HIDDEN_STATES = ("chained", "target")
LAYOUTS = ("mimo", "deepseek_v3")
NUM_MODULES_KEY = hf.MTP_NUM_MODULES_KEY
HIDDEN_STATE_KEY = "mtp_hidden_state"
CHAIN_KEY = "mtp_chain_after_final_norm"
# DeepSeek-V3 decoder-layer tensors and config fields of layers specjax has not (module docstring): what they are.
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")
_MLA_TENSORS = ("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa.", "self_attn.kv_b_proj.")
_MOE_TENSORS = ("mlp.experts.", "mlp.shared_experts.", "mlp.gate.weight")
# The feeding a checkpoint without HIDDEN_STATE_KEY was trained with, by architecture (MiMo: the target's
# hidden state at every module, sglang-jax PR #1256); others chain, as DeepSeek-V3's recursion does.
DEFAULT_HIDDEN_STATE = {"MiMoForCausalLM": "target"}


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """layer: the modules' decoder layers (num_layers = the number of modules; hidden_size and vocab_size
    are the target's). hidden_state: what feeds module m > 0, 'chained' or 'target'; chain_after_final_norm:
    whether a chained module reads the previous one's output after its final norm (MiMo) or before it
    (DeepSeek-V3) (module docstring)."""

    layer: ModelConfig
    hidden_state: str = "chained"
    chain_after_final_norm: bool = True

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
                 attention_mask: Bool[Array, "B T S"] | None = None,
                 ) -> tuple[Float[Array, "B T D"], Float[Array, "B T D"], KVCache | None]:
        """Module `module` (a static int) over T entries (hidden[:, t], tokens[:, t]) at slots after its cache
        layer's fill level (cache.lengths), or causally among themselves without a cache; attention_mask:
        which cache slots each entry sees (a draft tree's), in place of the causal rule. Returns its outputs
        after its final norm (the logits' input), what a chained next module reads (the same, or before the
        final norm: chain_after_final_norm) and the cache with lengths + T."""
        c = self.config.layer
        dtype = c.jnp_dtype
        embedded = normalize(embed[tokens].astype(dtype), self.token_norm[...][module], None, c)
        normed = normalize(hidden.astype(dtype), self.hidden_norm[...][module], None, c)
        x = jnp.einsum("btf,fd->btd", jnp.concatenate([normed, embedded], -1),
                       self.input_proj[...][module].astype(dtype))
        slots = query_slots_for(tokens.shape[0], tokens.shape[1], cache)

        def run_layer(x, layer, cache):  # rematerialised in training by c.remat
            return decoder_layer(x, layer, module, positions, slots, cache, c, visible=attention_mask)

        layer_out, cache = checkpointed(run_layer, c)(x, self.layer(module), cache)
        out = normalize(layer_out, self.final_norm[...][module], None, c)
        chained = out if self.config.chain_after_final_norm else layer_out
        return out, chained, None if cache is None else cache.with_lengths(cache.lengths + tokens.shape[1])

    def over_sequence(self, tokens: Int[Array, "B T2"], target_hidden: Float[Array, "B T D"],
                      embed: Float[Array, "V D"], hidden_state: str | None = None, cache: KVCache | None = None
                      ) -> tuple[list[Float[Array, "B T D"]], KVCache | None]:
        """Every module over a whole sequence, as they are trained: module m at position s (0 .. T-1, T the
        hidden states' length) reads token x_{s+m+1} of `tokens` (zeros past its end) and the hidden state that
        `hidden_state` (default: the config's) says (chained: what __call__ returns for chaining). Returns each module's outputs [B, T, D] (module m's
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
            out, previous, cache = self(module, shifted, fed, positions, cache, embed)
            cache = None if cache is None else cache.with_lengths(start)
            outs.append(out)
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

def _swapped_halves(w):
    """[2D, ...] with its two D halves exchanged: MiMo's input order [hidden, embedding] <-> DeepSeek-V3's."""
    half = w.shape[0] // 2
    return jnp.concatenate([w[half:], w[:half]], axis=0)


def _rules(config: MTPConfig, layout: str) -> list[hf.Rule]:
    c = config.layer
    if layout == "mimo":
        prefix = hf.MTP_TENSOR_PREFIX + "{i}."
        rules = [hf.same("token_norm", prefix + "token_layernorm.weight"),
                 hf.same("hidden_norm", prefix + "hidden_layernorm.weight"),
                 hf.transposed("input_proj", prefix + "input_proj.weight"),
                 hf.same("final_norm", prefix + "final_layernorm.weight")]
    else:  # {i}: num_hidden_layers + the module (fill_from_rules' first_layer)
        prefix = "model.layers.{i}."
        rules = [hf.same("token_norm", prefix + "enorm.weight"), hf.same("hidden_norm", prefix + "hnorm.weight"),
                 hf.Rule(("input_proj",), (prefix + "eh_proj.weight",), lambda w: (_swapped_halves(w.T),),
                         lambda w: (_swapped_halves(w).T,)),
                 hf.same("final_norm", prefix + "shared_head.norm.weight")]
    return [dataclasses.replace(rule, layered=True) for rule in [*rules, *hf.decoder_layer_rules(c, prefix)]]


def layout_of(folder: Path, raw: dict) -> str | None:
    """Which of LAYOUTS a checkpoint's MTP modules are in, by its tensors (None: it holds none)."""
    names = hf.tensor_names(folder)
    if any(name.startswith(hf.MTP_TENSOR_PREFIX) for name in names):
        return "mimo"
    layers = hf.deepseek_mtp_layers(raw)
    if layers and f"model.layers.{layers[0]}.eh_proj.weight" in names:
        return "deepseek_v3"
    return None


def _refuse_unsupported_layers(raw: dict, names: set[str], path: Path) -> None:
    """DeepSeek-V3's own decoder layers (MLA attention, MoE MLP) are not specjax's: refused naming the config
    field or tensor that says so."""
    for field in _MLA_FIELDS:
        if raw.get(field) is not None:
            raise hf.CheckpointError(
                f"{path}: {field} = {raw[field]!r}: MTP modules whose decoder layer has multi-head latent attention "
                "(DeepSeek-V3's MLA) are not supported: allowed null (a dense Llama-family layer, self_attn.q_proj / "
                "k_proj / v_proj / o_proj)")
    for name in sorted(hf.mtp_tensor_names(names, raw)):
        if any(part in name for part in _MLA_TENSORS):
            raise hf.CheckpointError(f"{path.parent}: tensor {name!r}: MTP modules whose decoder layer has multi-head "
                                     "latent attention (MLA) are not supported: allowed self_attn.q_proj / k_proj / "
                                     "v_proj / o_proj")
        if any(part in name for part in _MOE_TENSORS):
            raise hf.CheckpointError(
                f"{path.parent}: tensor {name!r} (n_routed_experts = {raw.get('n_routed_experts')!r}): MTP modules "
                "whose decoder layer is a mixture of experts are not supported: allowed a dense MLP "
                "(mlp.gate_proj / up_proj / down_proj)")


def layer_config(raw: dict, path: Path, layout: str = "mimo") -> ModelConfig:
    """The modules' decoder-layer shape from config.json: in MiMo's layout a Qwen2 layer, whatever
    `attention_bias` says (MiMo's Qwen2Attention has q/k/v biases and no output bias); in DeepSeek-V3's the
    config's own architecture's layer (a Llama-family one)."""
    num_modules = raw.get(NUM_MODULES_KEY) or 0
    if not isinstance(num_modules, int) or num_modules < 1:
        raise hf.CheckpointError(f"{path}: {NUM_MODULES_KEY} = {num_modules!r}: a checkpoint for method 'mtp' needs "
                                 "MTP modules (allowed a positive integer, e.g. a MiMo checkpoint's)")
    architectures = ["MiMoForCausalLM"] if layout == "mimo" else raw.get("architectures")
    return hf.config_from_hf({**raw, "architectures": architectures, "num_hidden_layers": num_modules}, path)


def num_modules_in(folder: Path) -> int:
    """config.json's num_nextn_predict_layers (0 where absent or unreadable)."""
    value = hf.config_json_or_empty(folder).get(NUM_MODULES_KEY) or 0
    return value if isinstance(value, int) else 0


def load_mtp(folder: str | Path, target_config: ModelConfig, shared: tuple[Array, Array | None] | None = None
             ) -> MTPModules:
    """The MTP modules of a checkpoint folder in either layout (the target's own checkpoint or a folder of
    the modules alone), in the target's dtypes. shared: the target's (embedding [V, D], LM head [D, V] or
    None when tied), which DeepSeek-V3's layout stores copies of: given, the copies must equal them."""
    folder = Path(folder)
    raw = hf.read_config_json(folder)
    path = folder / hf.CONFIG_FILE
    layout = layout_of(folder, raw) or "mimo"  # none: layer_config refuses the missing modules or their count
    if layout == "deepseek_v3":
        _refuse_unsupported_layers(raw, hf.tensor_names(folder), path)
    layer = dataclasses.replace(layer_config(raw, path, layout), param_dtype=target_config.param_dtype,
                                dtype=target_config.dtype, vocab_size=target_config.vocab_size)
    architecture = (raw.get("architectures") or [None])[0]
    hidden_state = raw.get(HIDDEN_STATE_KEY, DEFAULT_HIDDEN_STATE.get(architecture, "chained"))
    try:
        config = MTPConfig(layer=layer, hidden_state=hidden_state,
                           chain_after_final_norm=bool(raw.get(CHAIN_KEY, layout == "mimo")))
    except ConfigError as error:
        raise hf.CheckpointError(f"{path}: {error}") from error
    reader = hf.TensorReader(folder)
    modules = nnx.eval_shape(lambda: init_mtp(config))
    first = hf.deepseek_mtp_layers(raw).start if layout == "deepseek_v3" else 0
    used = hf.fill_from_rules(modules, _rules(config, layout), reader, folder, config.num_modules, "MTP modules",
                              first_layer=first)
    if layout == "deepseek_v3":
        used |= _check_shared_copies(reader, raw, shared, folder)
    hf.check_all_used(reader, used | (reader.keys() - hf.mtp_tensor_names(reader.keys(), raw)), folder, "MTP modules")
    return modules


def _check_shared_copies(reader: hf.TensorReader, raw: dict, shared, folder: Path) -> set[str]:
    """DeepSeek-V3's per-module copies of the target's embedding and LM head, checked equal to the target's
    (in its dtype) where `shared` gives them; returns their names."""
    names = set()
    for i in hf.deepseek_mtp_layers(raw):
        for key, index, what in ((f"model.layers.{i}.embed_tokens.weight", 0, "embedding (model.embed_tokens)"),
                                 (f"model.layers.{i}.shared_head.head.weight", 1, "LM head (lm_head)")):
            if key not in reader.keys():
                continue
            names.add(key)
            if shared is None:
                continue
            embed, lm_head = shared
            ours = embed if index == 0 or lm_head is None else lm_head.T  # a tied head is the embedding
            copy = reader.get(key)
            if copy.shape != ours.shape or not bool(jnp.array_equal(copy.astype(ours.dtype), ours)):
                raise hf.CheckpointError(
                    f"{folder}: tensor {key!r} differs from the target's {what}: MTP modules draft with the target's "
                    "embedding and LM head, of which DeepSeek-V3's layout stores copies (allowed: equal copies)")
    return names


def save_mtp(modules: MTPModules, folder: str | Path, extra_config: dict | None = None, *, layout: str = "mimo",
             target=None) -> None:
    """Writes the modules alone (config.json: the layer's fields, the number of modules, the default feeding)
    in MiMo's tensor names or DeepSeek-V3's (layout, LAYOUTS); load_mtp reads either back. DeepSeek-V3's
    names number the modules after the target's layers and carry copies of its embedding and LM head:
    `target` (a Transformer) gives them."""
    if not isinstance(modules.layers, StackedLayers):
        raise ValueError("modules.layers is in the decoding layout (mtp.mtp_to_decoding_layout), which is not a "
                         "checkpoint layout: save the modules it was made from")
    if layout not in LAYOUTS or (layout == "deepseek_v3") != (target is not None):
        raise ValueError(f"save_mtp layout = {layout!r} with target {'given' if target is not None else 'None'}: "
                         f"allowed 'mimo' without a target, 'deepseek_v3' with the target's Transformer")
    config = modules.config
    raw = hf.config_to_hf(config.layer)
    raw.update({NUM_MODULES_KEY: config.num_modules, HIDDEN_STATE_KEY: config.hidden_state,
                CHAIN_KEY: config.chain_after_final_norm})
    extra, first = {}, 0
    if layout == "mimo":
        raw.update({"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "num_hidden_layers": 0})
    else:
        first = target.config.num_layers
        raw["num_hidden_layers"] = first
        embed = target.embed[...]
        head = embed if target.lm_head is None else target.lm_head[...].T
        for i in range(first, first + config.num_modules):
            extra.update({f"model.layers.{i}.embed_tokens.weight": embed, f"model.layers.{i}.shared_head.head.weight": head})
    raw.update(extra_config or {})
    hf.write_from_rules(modules, _rules(config, layout), folder, raw, extra, num_layers=config.num_modules,
                        first_layer=first)

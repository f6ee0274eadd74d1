"""Hugging Face checkpoint folders (config.json + safetensors) <-> specjax models, both directions.

Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and GPT2LMHeadModel. Each
architecture is a table of `Rule`s mapping Hugging Face tensors of one layer (or of the whole model) to
specjax parameters and back; `load` and `save` run the same table in opposite directions, so the two
cannot drift apart. Every problem with a checkpoint (unsupported architecture, missing config field,
missing, unexpected or mis-shaped tensor) raises `CheckpointError` naming the file and the thing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from specjax.config import EXECUTION_FIELDS, ConfigError, ModelConfig, RopeScaling
from specjax.models.transformer import StackedLayers, Transformer

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

LLAMA_FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3"}
# Architectures whose LM is one of the above with multi-token prediction modules beside it (model.mtp_layers.*,
# the drafter of method 'mtp': specjax.models.mtp): the LM loads as that architecture, the modules are left out.
MTP_HOSTS = {"MiMoForCausalLM": "Qwen2ForCausalLM"}
MTP_TENSOR_PREFIX = "model.mtp_layers."
# DeepSeek-V3's layout instead appends the modules as decoder layers model.layers.{num_hidden_layers + k}.
MTP_NUM_MODULES_KEY = "num_nextn_predict_layers"
SUPPORTED_ARCHITECTURES = (*LLAMA_FAMILY, "GPT2LMHeadModel", *MTP_HOSTS)
# Buffers some checkpoints carry that are recomputed, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")

# Parameter dtypes kept as stored; any other checkpoint dtype loads as float32.
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


class CheckpointError(ValueError):
    """A checkpoint folder cannot be read or written as asked; the message names the file and field."""


# ----------------------------------------------------------------------------------------- config.json

def _field(hf: dict, name: str, path: Path, default: Any = ..., *, architecture: str):
    value = hf.get(name, default)
    if value is ...:
        raise CheckpointError(f"{path}: field {name!r} is missing; {architecture} needs it")
    return value


def _rope_from_hf(hf: dict, path: Path) -> tuple[float, RopeScaling | None]:
    """Reads rope theta and scaling from either transformers-5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` keys."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in ("llama3", "linear"):
        raise CheckpointError(f"{path}: rope type {rope_type!r} is not supported: allowed 'default', "
                              "'llama3', 'linear'")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    scaling = {k: params[k] for k in keys if k in params}
    if "factor" not in scaling:
        raise CheckpointError(f"{path}: rope scaling of type {rope_type!r} is missing field 'factor'")
    return theta, RopeScaling(rope_type=rope_type, **scaling)


def config_from_hf(hf: dict, path: Path = Path(CONFIG_FILE)) -> ModelConfig:
    """Maps a parsed config.json onto a ModelConfig (dtypes float32; `load` sets them)."""
    architectures = hf.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture in MTP_HOSTS:  # MiMo's Qwen2Attention has q/k/v biases only, whatever attention_bias says
        hf = {key: value for key, value in hf.items() if key != "attention_bias"}
        architecture = MTP_HOSTS[architecture]
        hf["architectures"] = [architecture]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture {architecture!r} is not supported: allowed "
                              f"{list(SUPPORTED_ARCHITECTURES)}")

    def field(name, default=...):
        return _field(hf, name, path, default, architecture=architecture)

    try:
        if architecture == "GPT2LMHeadModel":
            return _gpt2_config(field, path)
        return _llama_family_config(hf, field, path, architecture)
    except ConfigError as error:
        raise CheckpointError(f"{path}: {error}") from error


def _llama_family_config(hf: dict, field: Callable, path: Path, architecture: str) -> ModelConfig:
    if field("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported: allowed 'silu'")
    family = LLAMA_FAMILY[architecture]
    num_heads = field("num_attention_heads")
    hidden = field("hidden_size")
    theta, scaling = _rope_from_hf(hf, path)
    sliding_window = None
    if family == "mistral":
        sliding_window = field("sliding_window", None)
    if family in ("qwen2", "qwen3") and field("use_sliding_window", False):
        raise CheckpointError(f"{path}: use_sliding_window=true is not supported for {architecture}: allowed false")
    attention_bias = bool(field("attention_bias", False))
    return ModelConfig(
        architecture=architecture,
        vocab_size=field("vocab_size"),
        hidden_size=hidden,
        num_layers=field("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=field("num_key_value_heads", None) or num_heads,
        head_dim=field("head_dim", None) or hidden // num_heads,
        intermediate_size=field("intermediate_size"),
        max_position_embeddings=field("max_position_embeddings"),
        norm="rms",
        norm_eps=float(field("rms_norm_eps", 1e-6)),
        position="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        mlp="gated_silu",
        qkv_bias=attention_bias or family == "qwen2",
        qk_norm=family == "qwen3",
        out_bias=attention_bias,
        mlp_bias=bool(field("mlp_bias", False)),
        tie_word_embeddings=bool(field("tie_word_embeddings", False)),
        sliding_window=sliding_window,
        init_std=float(field("initializer_range", 0.02)),
    )


def _gpt2_config(field: Callable, path: Path) -> ModelConfig:
    activation = field("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{path}: activation_function {activation!r} is not supported: allowed "
                              "'gelu_new', 'gelu_pytorch_tanh'")
    if not field("scale_attn_weights", True) or field("scale_attn_by_inverse_layer_idx", False):
        raise CheckpointError(f"{path}: GPT-2 attention scaling other than 1/sqrt(head_dim) is not "
                              "supported: allowed scale_attn_weights=true, scale_attn_by_inverse_layer_idx=false")
    hidden, num_heads = field("n_embd"), field("n_head")
    return ModelConfig(
        architecture="GPT2LMHeadModel",
        vocab_size=field("vocab_size"),
        hidden_size=hidden,
        num_layers=field("n_layer"),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        intermediate_size=field("n_inner", None) or 4 * hidden,
        max_position_embeddings=field("n_positions"),
        norm="layer",
        norm_eps=float(field("layer_norm_epsilon", 1e-5)),
        position="learned",
        mlp="gelu_tanh",
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        norm_bias=True,
        tie_word_embeddings=bool(field("tie_word_embeddings", True)),
        init_std=float(field("initializer_range", 0.02)),
    )


def config_to_hf(config: ModelConfig) -> dict:
    """The config.json that transformers reads back as the same model."""
    c = config
    if c.architecture == "GPT2LMHeadModel":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
            "n_embd": c.hidden_size, "n_layer": c.num_layers, "n_head": c.num_heads,
            "n_inner": c.intermediate_size, "n_positions": c.max_position_embeddings,
            "layer_norm_epsilon": c.norm_eps, "activation_function": "gelu_new",
            "tie_word_embeddings": c.tie_word_embeddings, "initializer_range": c.init_std,
        }
    hf = {
        "architectures": [c.architecture], "model_type": LLAMA_FAMILY[c.architecture],
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.norm_eps,
        "hidden_act": "silu", "tie_word_embeddings": c.tie_word_embeddings, "initializer_range": c.init_std,
        # transformers >= 5 keeps theta and scaling together in rope_parameters.
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
    }
    if c.rope_scaling is not None:
        hf["rope_parameters"].update(dataclasses.asdict(c.rope_scaling))
    family = LLAMA_FAMILY[c.architecture]
    if family == "llama":
        hf["attention_bias"], hf["mlp_bias"] = c.qkv_bias, c.mlp_bias
    elif family == "qwen3":
        hf["attention_bias"], hf["use_sliding_window"] = c.qkv_bias, False
    elif family == "mistral":
        hf["sliding_window"] = c.sliding_window
    elif family == "qwen2":
        hf["use_sliding_window"] = False
    expected = config_from_hf(hf)
    mismatched = [f.name for f in dataclasses.fields(c) if f.name not in EXECUTION_FIELDS
                  and getattr(expected, f.name) != getattr(c, f.name)]
    if mismatched:
        raise CheckpointError(f"{c.architecture} cannot express this config in config.json; fields "
                              f"{mismatched} differ from what the architecture implies")
    return hf


# -------------------------------------------------------------------------------------------- tensors

@dataclasses.dataclass(frozen=True)
class Rule:
    """Maps Hugging Face tensors (keys may contain `{i}`, the layer) to specjax parameters (dotted
    paths into the model) and back. `to_ours` and `to_hf` are inverses, over numpy-like arrays."""

    ours: tuple[str, ...]
    hf: tuple[str, ...]
    to_ours: Callable[..., tuple]
    to_hf: Callable[..., tuple]
    layered: bool | None = None  # stacked over layers; by default when the keys contain {i}

    @property
    def per_layer(self) -> bool:
        return self.layered if self.layered is not None else "{i}" in self.hf[0]


def same(prefix_ours: str, key: str) -> Rule:
    return Rule((prefix_ours,), (key,), lambda w: (w,), lambda w: (w,))


def in_proj(ours: str, key: str, d_in: int, *out_dims: int) -> Rule:
    """torch Linear [out, in] -> ours [in, *out_dims] (attention q/k/v, MLP up/gate)."""
    return Rule((ours,), (key,), lambda w: (w.T.reshape(d_in, *out_dims),),
                lambda w: (w.reshape(d_in, -1).T,))


def out_proj(ours: str, key: str, d_out: int, *in_dims: int) -> Rule:
    """torch Linear [out, in] -> ours [*in_dims, out] (attention output, MLP down)."""
    return Rule((ours,), (key,), lambda w: (w.T.reshape(*in_dims, d_out),),
                lambda w: (w.reshape(-1, d_out).T,))


def reshaped(ours: str, key: str, *our_shape: int) -> Rule:
    """A bias stored flat in the checkpoint and per head in specjax."""
    return Rule((ours,), (key,), lambda b: (b.reshape(our_shape),), lambda b: (b.reshape(-1),))


def decoder_layer_rules(c: ModelConfig, prefix: str) -> list[Rule]:
    """The Llama family's decoder-layer tensors (Qwen3's q / k norms included), named `prefix` + the
    transformers name (prefix holds `{i}`), to the StackedLayers at `layers`."""
    D, H, K, E = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    rules = [
        same("layers.attn_norm", prefix + "input_layernorm.weight"),
        same("layers.mlp_norm", prefix + "post_attention_layernorm.weight"),
        in_proj("layers.wq", prefix + "self_attn.q_proj.weight", D, H, E),
        in_proj("layers.wk", prefix + "self_attn.k_proj.weight", D, K, E),
        in_proj("layers.wv", prefix + "self_attn.v_proj.weight", D, K, E),
        out_proj("layers.wo", prefix + "self_attn.o_proj.weight", D, H, E),
        in_proj("layers.w_gate", prefix + "mlp.gate_proj.weight", D, c.intermediate_size),
        in_proj("layers.w_up", prefix + "mlp.up_proj.weight", D, c.intermediate_size),
        out_proj("layers.w_down", prefix + "mlp.down_proj.weight", D, c.intermediate_size),
    ]
    if c.qk_norm:
        rules += [same("layers.q_norm", prefix + "self_attn.q_norm.weight"),
                  same("layers.k_norm", prefix + "self_attn.k_norm.weight")]
    if c.qkv_bias:
        rules += [reshaped("layers.bq", prefix + "self_attn.q_proj.bias", H, E),
                  reshaped("layers.bk", prefix + "self_attn.k_proj.bias", K, E),
                  reshaped("layers.bv", prefix + "self_attn.v_proj.bias", K, E)]
    if c.out_bias:
        rules.append(same("layers.bo", prefix + "self_attn.o_proj.bias"))
    if c.mlp_bias:
        rules += [same("layers.b_gate", prefix + "mlp.gate_proj.bias"),
                  same("layers.b_up", prefix + "mlp.up_proj.bias"),
                  same("layers.b_down", prefix + "mlp.down_proj.bias")]
    return rules


def transposed(ours: str, key: str) -> Rule:
    """A torch Linear's [out, in] weight stored [in, out] here (an LM head, a projection)."""
    return Rule((ours,), (key,), lambda w: (w.T,), lambda w: (w.T,))


def _llama_rules(c: ModelConfig) -> list[Rule]:
    rules = [same("embed", "model.embed_tokens.weight"), same("final_norm", "model.norm.weight"),
             *decoder_layer_rules(c, "model.layers.{i}.")]
    if not c.tie_word_embeddings:
        rules.append(transposed("lm_head", "lm_head.weight"))
    return rules


def _gpt2_rules(c: ModelConfig) -> list[Rule]:
    """GPT-2 stores Conv1D weights as [in, out] and q, k, v fused along the output axis."""
    D, H, E = c.hidden_size, c.num_heads, c.head_dim
    layer = "transformer.h.{i}."
    qkv_names = ("layers.wq", "layers.wk", "layers.wv")
    rules = [
        same("embed", "transformer.wte.weight"),
        same("pos_embed", "transformer.wpe.weight"),
        same("final_norm", "transformer.ln_f.weight"),
        same("final_norm_bias", "transformer.ln_f.bias"),
        same("layers.attn_norm", layer + "ln_1.weight"),
        same("layers.attn_norm_bias", layer + "ln_1.bias"),
        same("layers.mlp_norm", layer + "ln_2.weight"),
        same("layers.mlp_norm_bias", layer + "ln_2.bias"),
        Rule(qkv_names, (layer + "attn.c_attn.weight",),
             lambda w: tuple(part.reshape(D, H, E) for part in jnp.split(w, 3, axis=1)),
             lambda q, k, v: (jnp.concatenate([t.reshape(D, -1) for t in (q, k, v)], axis=1),)),
        Rule(("layers.bq", "layers.bk", "layers.bv"), (layer + "attn.c_attn.bias",),
             lambda b: tuple(part.reshape(H, E) for part in jnp.split(b, 3)),
             lambda q, k, v: (jnp.concatenate([t.reshape(-1) for t in (q, k, v)]),)),
        Rule(("layers.wo",), (layer + "attn.c_proj.weight",), lambda w: (w.reshape(H, E, D),),
             lambda w: (w.reshape(-1, D),)),
        same("layers.bo", layer + "attn.c_proj.bias"),
        same("layers.w_up", layer + "mlp.c_fc.weight"),
        same("layers.b_up", layer + "mlp.c_fc.bias"),
        same("layers.w_down", layer + "mlp.c_proj.weight"),
        same("layers.b_down", layer + "mlp.c_proj.bias"),
    ]
    if not c.tie_word_embeddings:
        rules.append(transposed("lm_head", "lm_head.weight"))
    return rules


def rules_for(config: ModelConfig) -> list[Rule]:
    return _gpt2_rules(config) if config.architecture == "GPT2LMHeadModel" else _llama_rules(config)


def _get_param(model: Transformer, path: str) -> nnx.Param:
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class TensorReader:
    """Reads tensors by key from a single-file or sharded (index.json) safetensors checkpoint.

    file / index: the single file's name and the shard index's (None: never sharded); missing_hint is
    appended to the error when neither is there."""

    def __init__(self, model_dir: Path, file: str = SINGLE_FILE, *, index: str | None = INDEX_FILE,
                 missing_hint: str = ""):
        self.model_dir = model_dir
        self._handles: dict[Path, Any] = {}
        if index is not None and (model_dir / index).exists():
            weight_map = json.loads((model_dir / index).read_text())["weight_map"]
            self.files = {key: model_dir / name for key, name in weight_map.items()}
        elif (model_dir / file).exists():
            self.files = {key: model_dir / file for key in self._open(model_dir / file).keys()}
        else:
            either = file if index is None else f"{file} or {index}"
            raise CheckpointError(f"{model_dir}: no {either} found{missing_hint}")

    def keys(self) -> set[str]:
        return set(self.files)

    def resolve(self, key: str) -> str:
        """The stored name of a tensor: original GPT-2 checkpoints drop the "transformer." prefix."""
        if key not in self.files and key.removeprefix("transformer.") in self.files:
            return key.removeprefix("transformer.")
        return key

    def get(self, key: str) -> jax.Array:
        if key not in self.files:
            raise CheckpointError(f"{self.model_dir}: tensor {key!r} is missing")
        path = self.files[key]
        if not path.exists():
            raise CheckpointError(f"{path}: shard named in {INDEX_FILE} does not exist")
        try:
            return self._open(path).get_tensor(key)
        except Exception as error:  # safetensors raises its own error types for corrupt data
            raise CheckpointError(f"{path}: cannot read tensor {key!r}: {error}") from error

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                # As jax arrays: numpy has no bfloat16, the usual dtype of released checkpoints.
                self._handles[path] = safe_open(path, framework="flax")
            except Exception as error:
                raise CheckpointError(f"{path}: not a readable safetensors file: {error}") from error
        return self._handles[path]

    def dtype(self) -> str:
        first = self.get(next(iter(sorted(self.files))))
        return jnp.dtype(first.dtype).name

    def param_dtype(self, requested: str | None = None) -> str:
        """requested, else the checkpoint's dtype where it is kept as stored (CHECKPOINT_DTYPES), else float32."""
        if requested is not None:
            return requested
        stored = self.dtype()
        return stored if stored in CHECKPOINT_DTYPES else "float32"


def tensor_names(folder: Path, file: str = SINGLE_FILE) -> set[str]:
    """The tensor names of a folder's safetensors checkpoint (single file or sharded); empty where there is none
    readable. Reads headers only: what drafters' `recognizes` look at."""
    try:
        return TensorReader(Path(folder), file).keys()
    except CheckpointError:
        return set()


def config_json_or_empty(folder: Path) -> dict:
    """A folder's config.json parsed, or {} where it has none that parses (recognizers' view of a folder)."""
    try:
        return read_config_json(folder)
    except (CheckpointError, ValueError):
        return {}


def read_config_json(folder: Path, missing_hint: str = "") -> dict:
    """A checkpoint folder's config.json, parsed; missing_hint is appended to the error when it is absent."""
    path = Path(folder) / CONFIG_FILE
    if not path.exists():
        raise CheckpointError(f"{folder}: no {CONFIG_FILE} found{missing_hint}")
    return json.loads(path.read_text())


def deepseek_mtp_layers(raw: dict) -> range:
    """The layer indices DeepSeek-V3's layout gives MTP modules, num_hidden_layers + k for the config's
    num_nextn_predict_layers modules (empty where the config names none)."""
    first, count = raw.get("num_hidden_layers"), raw.get(MTP_NUM_MODULES_KEY)
    valid = isinstance(first, int) and isinstance(count, int) and count > 0
    return range(first, first + count) if valid else range(0)


def mtp_tensor_names(keys: set[str], raw: dict) -> set[str]:
    """The tensors of MTP modules among a checkpoint's keys, in either layout: MiMo's model.mtp_layers.*, or
    DeepSeek-V3's layers past the LM's (deepseek_mtp_layers); raw is its config.json."""
    prefixes = (MTP_TENSOR_PREFIX, *(f"model.layers.{i}." for i in deepseek_mtp_layers(raw)))
    return {key for key in keys if key.startswith(prefixes)}


def load_config(model_dir: str | Path) -> ModelConfig:
    raw = read_config_json(model_dir, " (is this a Hugging Face model folder?)")
    return config_from_hf(raw, Path(model_dir) / CONFIG_FILE)


def load(model_dir: str | Path, *, param_dtype: str | None = None, dtype: str | None = None) -> Transformer:
    """Loads a checkpoint folder. param_dtype defaults to the checkpoint's; dtype to param_dtype."""
    model_dir = Path(model_dir)
    reader = TensorReader(model_dir)
    param_dtype = reader.param_dtype(param_dtype)
    config = dataclasses.replace(load_config(model_dir), param_dtype=param_dtype, dtype=dtype or param_dtype)
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    used = fill_from_rules(model, rules_for(config), reader, model_dir, config.num_layers, config.architecture)
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints store it anyway
    used |= mtp_tensor_names(reader.keys(), read_config_json(model_dir))  # the drafter's (method 'mtp')
    check_all_used(reader, used, model_dir, config.architecture)
    return model


def fill_from_rules(model: nnx.Module, rules: list[Rule], reader: TensorReader, folder: Path, num_layers: int,
                    description: str, first_layer: int = 0) -> set[str]:
    """Sets every parameter of an abstract (eval_shape) module from the checkpoint through the rule
    table, checking each tensor's shape; returns the keys used. Layer i is named {i} = first_layer + i."""
    dtype = model.config.jnp_param_dtype if isinstance(model.config, ModelConfig) else model.config.layer.jnp_param_dtype
    used: set[str] = set()
    for rule in rules:
        layers = range(num_layers) if rule.per_layer else [None]
        per_layer_values = []
        shapes = _expected_hf_shapes(model, rule)
        for i in layers:
            tensors = []
            named = None if i is None else first_layer + i
            for key, expected in zip((reader.resolve(key.format(i=named)) for key in rule.hf), shapes):
                tensor = reader.get(key)
                if tuple(tensor.shape) != expected:
                    raise CheckpointError(f"{folder}: tensor {key!r} has shape {tuple(tensor.shape)}; expected "
                                          f"{expected} for {description} ({_shape_summary(model.config)})")
                tensors.append(tensor.astype(jnp.float32))
                used.add(key)
            per_layer_values.append(rule.to_ours(*tensors))
        for n, name in enumerate(rule.ours):
            values = [v[n] for v in per_layer_values]
            value = jnp.stack(values) if rule.per_layer else values[0]
            _get_param(model, name).set_value(value.astype(dtype))
    unset = [path for path, leaf in jax.tree_util.tree_leaves_with_path(model)
             if isinstance(leaf, jax.ShapeDtypeStruct)]
    if unset:  # a rule table that misses a parameter is a bug here, not in the checkpoint
        raise AssertionError(f"parameters not covered by the {description} rules: {unset}")
    return used


def check_all_used(reader: TensorReader, used: set[str], folder: Path, description: str) -> None:
    """An unexpected tensor means part of the checkpoint would be silently ignored: refuse it."""
    unexpected = sorted(k for k in reader.keys() - used if not k.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise CheckpointError(f"{folder}: tensors not used by {description}: {unexpected[:8]}"
                              f"{' ...' if len(unexpected) > 8 else ''}")


def _shape_summary(config) -> str:
    c = config if isinstance(config, ModelConfig) else config.layer
    return (f"hidden_size={c.hidden_size}, num_heads={c.num_heads}, num_kv_heads={c.num_kv_heads}, "
            f"head_dim={c.head_dim}, vocab_size={c.vocab_size}")


def _expected_hf_shapes(model: nnx.Module, rule: Rule) -> list[tuple[int, ...]]:
    """The checkpoint shapes a rule expects, found by running `to_hf` on abstract parameters."""
    def one_layer(param):
        shape = param.get_value().shape
        return jax.ShapeDtypeStruct(shape[1:] if rule.per_layer else shape, jnp.float32)

    ours = [one_layer(_get_param(model, name)) for name in rule.ours]
    return [tuple(s.shape) for s in jax.eval_shape(rule.to_hf, *ours)]


def save(model: Transformer, model_dir: str | Path, *, max_shard_bytes: int = 4 << 30,
         extra_config: dict | None = None) -> None:
    """Writes a folder transformers loads: config.json and safetensors (sharded past max_shard_bytes).

    extra_config is merged into config.json (e.g. bos_token_id, eos_token_id).
    """
    if not isinstance(model.layers, StackedLayers):
        raise ValueError("model.layers is in the decoding layout (transformer.to_decoding_layout), which is not a "
                         "checkpoint layout: save the stacked model it was made from")
    config = model.config
    hf_config = {**config_to_hf(config), **(extra_config or {})}
    hf_config["dtype"] = config.param_dtype if config.param_dtype in CHECKPOINT_DTYPES else "float32"
    write_from_rules(model, rules_for(config), model_dir, hf_config, num_layers=config.num_layers,
                     max_shard_bytes=max_shard_bytes)


def write_from_rules(model: nnx.Module, rules: list[Rule], model_dir: str | Path, config_json: dict,
                     extra_tensors: dict | None = None, *, num_layers: int = 1, first_layer: int = 0,
                     max_shard_bytes: int = 4 << 30) -> None:
    """Writes config.json and the tensors the rule table maps the module to (plus extra_tensors); layer i
    is named {i} = first_layer + i."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, jax.Array] = {}
    for rule in rules:
        # On the host: a layer's slice and its layout change per tensor would each compile a program on the device.
        values = [np.asarray(_get_param(model, name)[...]) for name in rule.ours]
        layers = range(num_layers) if rule.per_layer else [None]
        for i in layers:
            ours = [v[i] if i is not None else v for v in values]
            for key, tensor in zip(rule.hf, rule.to_hf(*ours)):
                tensors[key.format(i=None if i is None else first_layer + i)] = jnp.asarray(tensor)
    tensors.update(extra_tensors or {})
    shards = _split_into_shards(tensors, max_shard_bytes)
    for stale in [*model_dir.glob("model*.safetensors"), model_dir / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], model_dir / SINGLE_FILE, metadata={"format": "pt"})
    else:
        weight_map = {}
        for n, shard in enumerate(shards, start=1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, model_dir / name, metadata={"format": "pt"})
            weight_map.update({key: name for key in shard})
        total = sum(t.nbytes for t in tensors.values())
        (model_dir / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (model_dir / CONFIG_FILE).write_text(json.dumps(config_json, indent=2) + "\n")


def _split_into_shards(tensors: dict[str, jax.Array], max_shard_bytes: int) -> list[dict[str, jax.Array]]:
    shards: list[dict[str, jax.Array]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += tensor.nbytes
    return shards


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """End-of-sequence ids from generation_config.json or config.json (an int or a list); () if none."""
    for name in ("generation_config.json", CONFIG_FILE):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


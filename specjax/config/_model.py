"""What a decoder-only LM is (ModelConfig, RopeScaling) and how it runs (its execution fields)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from specjax.config._checks import (DTYPES, require, require_choice, require_dtype_names, require_float,
                                    require_positive_ints)


REMAT_POLICIES = ("none", "layer", "dots")
ATTENTION_IMPLS = ("auto", "cudnn", "xla", "einsum")
MATMUL_PRECISIONS = ("auto", "default", "high", "highest")
# ModelConfig fields that say how a model runs rather than what it is: config.json holds none of them.
EXECUTION_FIELDS = ("param_dtype", "dtype", "remat", "attention_impl", "matmul_precision")


def matmul_precision_for(dtype: str, precision: str = "auto") -> str:
    """The matmul precision for compute dtype `dtype`: `precision` unless 'auto', which is 'highest' for
    float32 (no TF32 on GPUs) and 'default' for narrower dtypes (their products are unaffected)."""
    if precision != "auto":
        return precision
    return "highest" if dtype == "float32" else "default"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `llama3` is Llama 3.1's piecewise rule; `linear` divides all frequencies."""

    rope_type: Literal["llama3", "linear"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        require_choice(self, "rope_type", ("llama3", "linear"))
        require_float(self, "factor", 1)
        if self.rope_type == "llama3":
            require(self.high_freq_factor > self.low_freq_factor, "RopeScaling", "high_freq_factor",
                     self.high_freq_factor, f"a value > low_freq_factor ({self.low_freq_factor})")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and flavour of a decoder-only LM.

    One dataclass covers the Llama / Qwen2 / Qwen3 / Mistral family (RMSNorm, RoPE, gated SiLU MLP) and GPT-2
    (LayerNorm, learned positions, GELU MLP); `specjax.models.hf` maps Hugging Face config.json files
    onto it.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 4096
    norm: Literal["rms", "layer"] = "rms"
    norm_eps: float = 1e-6
    position: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    mlp: Literal["gated_silu", "gelu_tanh"] = "gated_silu"
    qkv_bias: bool = False
    # Qwen3: an RMSNorm over each query and key head (head_dim wide, its own scale) before RoPE.
    qk_norm: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # Storage dtype of the weights, and the dtype activations and matmuls run in.
    param_dtype: str = "float32"
    dtype: str = "float32"
    init_std: float = 0.02
    # Hugging Face architecture name this config round-trips to (LlamaForCausalLM, GPT2LMHeadModel, ...).
    architecture: str = "LlamaForCausalLM"
    # How the model runs, not what it is (EXECUTION_FIELDS: config.json holds none of them).
    # remat: what the backward pass keeps of each layer of a full forward (REMAT_POLICIES): 'none' keeps
    #   every activation; 'layer' keeps only each layer's input and recomputes the layer in the backward
    #   pass; 'dots' keeps the outputs of the weight products (no batch dimensions) and recomputes the rest.
    #   Training sets it from TrainingRun.remat; it changes memory and time, never the values.
    remat: str = "none"
    # attention_impl: how a forward without a cache, causal, with no mask given (training's, and any full
    #   forward) attends (ATTENTION_IMPLS). 'auto': jax.nn.dot_product_attention with cuDNN's flash
    #   attention on GPUs in bfloat16 / float16 (cuDNN takes only those), XLA's implementation otherwise;
    #   'cudnn' / 'xla' force one; 'einsum' the einsum attention every cached call uses. Calls with a cache,
    #   a mask or causal=False always take the einsum attention or the decoding layout's Pallas kernel.
    attention_impl: str = "auto"
    # matmul_precision: the precision of matrix products when inputs are float32 (MATMUL_PRECISIONS):
    #   'auto' is 'highest' for float32 compute (GPUs would otherwise take float32 products in TF32, whose
    #   rounding flips near-ties between two programs, so parity and losslessness checks fail there) and
    #   'default' for bfloat16 / float16; 'default' lets XLA choose (TF32 on GPUs), 'high' is 3-pass bf16.
    matmul_precision: str = "auto"

    def __post_init__(self):
        require_positive_ints(self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                              "intermediate_size", "max_position_embeddings")
        require(self.num_heads % self.num_kv_heads == 0, "ModelConfig", "num_kv_heads", self.num_kv_heads,
                f"a divisor of num_heads ({self.num_heads})")
        require_choice(self, "norm", ("rms", "layer"))
        require_choice(self, "position", ("rope", "learned"))
        require_choice(self, "mlp", ("gated_silu", "gelu_tanh"))
        require_float(self, "norm_eps", 0, low_open=True)
        require(self.sliding_window is None or self.sliding_window >= 1, "ModelConfig", "sliding_window",
                self.sliding_window, "None or an integer >= 1")
        require(self.rope_scaling is None or self.position == "rope", "ModelConfig", "rope_scaling",
                self.rope_scaling, "None when position is 'learned'")
        require_dtype_names(self, "param_dtype", "dtype")
        require(self.remat in REMAT_POLICIES, "ModelConfig", "remat", self.remat, f"one of {list(REMAT_POLICIES)}")
        require(self.attention_impl in ATTENTION_IMPLS, "ModelConfig", "attention_impl", self.attention_impl,
                f"one of {list(ATTENTION_IMPLS)}")
        require(self.matmul_precision in MATMUL_PRECISIONS, "ModelConfig", "matmul_precision",
                self.matmul_precision, f"one of {list(MATMUL_PRECISIONS)}")

    @property
    def resolved_matmul_precision(self) -> str:
        """matmul_precision with 'auto' resolved by the compute dtype (see the field)."""
        return matmul_precision_for(self.dtype, self.matmul_precision)

    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head (1 for MHA, num_heads for MQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self):
        return DTYPES[self.param_dtype]


"""Frozen, validated configuration dataclasses.

Every config is a frozen (hashable) dataclass so that it can be a static argument of `jax.jit`. Values
are checked when the object is built: a bad value raises `ConfigError` naming the field, the value and
what is allowed, so nothing wrong gets as far as a trace.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and what is allowed."""


def require(ok: bool, owner: str, field: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{owner}.{field} = {value!r} is invalid: allowed {allowed}")


DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float8_e4m3fn": jnp.float8_e4m3fn,
}


def dtype_from_name(name: str, field: str = "dtype"):
    """Maps a dtype name ('bfloat16', ...) to the jnp dtype; an unknown name is a ConfigError."""
    if name not in DTYPES:
        raise ConfigError(f"{field} = {name!r} is invalid: allowed {sorted(DTYPES)}")
    return DTYPES[name]


def require_positive_ints(config, *names: str) -> None:
    """Each named field of config is an integer >= 1."""
    for name in names:
        value = getattr(config, name)
        require(isinstance(value, int) and value >= 1, type(config).__name__, name, value, "an integer >= 1")


def require_dtype_names(config, *names: str) -> None:
    """Each named field of config is a dtype name of DTYPES."""
    for name in names:
        dtype_from_name(getattr(config, name), f"{type(config).__name__}.{name}")


# ModelConfig's execution settings (see the fields): what each allows.
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
        require(self.rope_type in ("llama3", "linear"), "RopeScaling", "rope_type", self.rope_type,
                "'llama3' or 'linear'")
        require(self.factor >= 1.0, "RopeScaling", "factor", self.factor, "a float >= 1")
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
        require(self.norm in ("rms", "layer"), "ModelConfig", "norm", self.norm, "'rms' or 'layer'")
        require(self.position in ("rope", "learned"), "ModelConfig", "position", self.position,
                "'rope' or 'learned'")
        require(self.mlp in ("gated_silu", "gelu_tanh"), "ModelConfig", "mlp", self.mlp,
                "'gated_silu' or 'gelu_tanh'")
        require(self.norm_eps > 0, "ModelConfig", "norm_eps", self.norm_eps, "a float > 0")
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


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How a token is drawn from logits: temperature, then top-k, then top-p (vLLM's order).

    temperature 0 is greedy decoding (argmax; top-k and top-p are then irrelevant). top_k 0 and
    top_p 1.0 switch those filters off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        require(self.temperature >= 0.0, "SamplingConfig", "temperature", self.temperature,
                "a float >= 0 (0 means greedy)")
        require(isinstance(self.top_k, int) and self.top_k >= 0, "SamplingConfig", "top_k", self.top_k,
                "an integer >= 0 (0 disables top-k)")
        require(0.0 < self.top_p <= 1.0, "SamplingConfig", "top_p", self.top_p,
                "a float in (0, 1] (1 disables top-p)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
VERIFY_IMPLS = ("auto", "pallas", "xla")
# The dynamic tree sizes `SpecConfig.total_tokens: auto` chooses from (specjax.tree_size).
AUTO_TREE_SIZES = (8, 16, 24, 32, 48, 64)
# Trees are verified by recursive rejection sampling ('standard'), traversal verification ('block': block
# verification generalised to trees), or in the benchmark mode (specjax.verify.tree).
TREE_REJECTION_SAMPLE_METHODS = ("standard", "block", "synthetic")


def check_token_tree(tree, depth: int) -> tuple[tuple[int, ...], ...]:
    """speculative_token_tree as tuples, or a ConfigError naming what is wrong with it."""
    def invalid(allowed: str):
        raise ConfigError(f"SpecConfig.speculative_token_tree = {tree!r} is invalid: allowed {allowed}")

    if not isinstance(tree, (list, tuple)) or not tree:
        invalid("a non-empty list of paths of top-k ranks, e.g. [[0], [1], [0, 0]]")
    paths = []
    for path in tree:
        if (not isinstance(path, (list, tuple)) or not path
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
            invalid(f"paths of integers >= 0, got {path!r}")
        path = tuple(path)
        if path in paths:
            invalid(f"each path once, got {path!r} twice")
        if len(path) > 1 and path[:-1] not in paths:
            invalid(f"every path after its parent, got {path!r} before {path[:-1]!r}")
        paths.append(path)
    if max(map(len, paths)) != depth:
        invalid(f"a deepest path of num_speculative_tokens = {depth} ranks, got {max(map(len, paths))}")
    return tuple(paths)


# Methods that draft with DFlash's block backbone (SpecConfig.dflash_full_block applies to them).
BLOCK_METHODS = ("dflash", "dspark")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding, with vLLM's `SpeculativeConfig` names and meanings.

    method: the drafter, a name in `specjax.proposers.PROPOSERS` (checked when the proposer is built:
      this module imports no registry, so a config alone loads no model code).
    num_speculative_tokens: K, tokens drafted per step.
    rejection_sample_method: 'standard' (Leviathan et al.), 'block' (Sun et al.'s joint prefix
      ratio) or 'synthetic' (benchmark mode, not lossless): a name in
      `specjax.verify.REJECTION_SAMPLE_METHODS`, checked when the verifier is chosen. At temperature 0
      the greedy verifier runs whatever is chosen here, except 'synthetic'.
    synthetic_acceptance_rates: unconditional acceptance rate of each draft position (K values,
      non-increasing, in [0, 1]).
    synthetic_acceptance_length: or a mean acceptance length L in [1, K + 1], turned into rates as vLLM
      does. Exactly one of them with 'synthetic', neither otherwise.
    draft_sample_method: 'greedy' drafts the argmax (the draft is one-hot to the verifier);
      'probabilistic' samples the processed draft distribution and verifies against it.
    prompt_lookup_min / prompt_lookup_max: n-gram lengths tried by method 'ngram', longest first.
    use_heterogeneous_vocab: draft and target with different tokenizers (vLLM's TLI): only with
      method 'draft_model' and greedy drafting.
    kv_cache_dtype: the drafter's KV cache dtype ('bfloat16', 'float8_e4m3fn', ...); None inherits
      the drafter's compute dtype.
    verify_impl: 'pallas' runs block verification of probabilistic drafts as the one-sweep Pallas
      kernel (interpreted on the CPU; where it cannot compile, e.g. a JAX without Pallas's GPU
      lowering, the jnp reference runs instead, with a warning), 'xla' the jnp reference; 'auto'
      takes whichever is faster on the backend (specjax.verify.AUTO_PALLAS_BACKENDS; today jnp
      everywhere). Both give the same tokens from the same draws.
    speculative_token_tree: a static draft tree as vLLM's former option wrote it, one tuple of top-k
      ranks per node, e.g. ((0,), (1,), (0, 0), (0, 1)): node (0, 1) is the second-ranked candidate of
      depth 2 under the first-ranked one of depth 1. Every node's parent (its path less the last rank)
      comes before it; the deepest path is num_speculative_tokens long. The target scores the whole
      tree in one forward (specjax.draft_tree) and recursive rejection sampling verifies it
      (specjax.verify.tree; rejection_sample_method 'standard'). Drafters that draft trees: 'medusa', 'draft_model'.
    total_tokens, top_k: a dynamic draft tree (EAGLE-2), rebuilt every step from the drafter's own
      confidences: the root's top_k children, then at each depth the top_k frontier nodes (by the product
      of draft probabilities along their path) each expanded to their top_k children, for
      num_speculative_tokens depths; the total_tokens candidates of highest path probability are kept,
      parents before children. Drafts are each node's top-k (deterministic: q = 1 to the verifier, as
      EAGLE's rule). Both or neither; not with speculative_token_tree. Drafters: 'eagle', 'eagle3', 'draft_model'.
      total_tokens 'auto': the size of AUTO_TREE_SIZES (those the depth and top_k can fill) that
      `specjax.decoding.generate` predicts fastest for this device, batch and drafter, from a short
      calibration run (specjax.tree_size); the cache has room for the largest.
    dflash_full_block: whether a DFlash drafter drafts its whole trained block (method 'dflash' only; null:
      auto, the whole block where K + 1 is smaller than it). True: the drafter runs its whole trained block
      (block_size - 1 mask positions) and proposes the first K drafts. False: it runs the anchor and K mask
      positions (vLLM's meaning of num_speculative_tokens for DFlash). None (default, auto) is True where
      K + 1 < block_size. A drafter trained on full blocks attends over a shorter block it never saw and
      drafts worse there: the full block accepted 41-45% more at K 3 and 7 on the default models for
      +0.6% a step at batch 1 and +7-10% at batch 16 at the 8B shape (docs/performance.md, "Acceptance:
      DFlash on the default models"; benchmarks/results/dflash_block_cost); set False where a step's cost
      grows with the block (large batches). Method 'dspark' (DFlash's backbone) takes it too.
    dspark_draft_topk: method 'dspark' only (vLLM's option): each draft is drawn from the dspark_draft_topk
      candidates of highest base (backbone) logit, with the Markov bias added to those only (vLLM's gathered
      bias: k rows of W2 read instead of V); null: the whole vocabulary. The draft probabilities the verifier
      sees are that restricted distribution, so verification stays lossless.
    mtp_hidden_state: what feeds MTP module k > 1 (method 'mtp' only): 'chained' (the previous module's
      output, DeepSeek-V3's recursion) or 'target' (the target's hidden state at every module, as MiMo was
      trained); null: the checkpoint's default (specjax.models.mtp).
    enable_adaptive_verification: vLLM's option: each step the loop chooses how many of the K drafts every
      row verifies, the width with the most expected tokens per second (specjax.adaptive): expected tokens
      from per-position acceptance estimates kept in the loop (a moving average of what each row's drafts
      had accepted; DSpark's confidence head where its drafts are deterministic), seconds from the device's
      cost curve. Lossless whatever it chooses (the choice is made before the target's scores are seen, and
      never from a sampled draft). Chains only (not with speculative_token_tree or total_tokens).
    adaptive_verify_widths: the verify widths (drafts scored per row) compiled into the loop, from which
      adaptive verification chooses each step by a `lax.switch` over target forwards of width + 1
      positions; increasing, in 0..K, with K last. null: 0, the powers of two below K, and K. [K] alone
      verifies the whole block with per-row masks, which saves nothing (docs/design.md, "Adaptive
      verification"). Only with enable_adaptive_verification.
    """

    method: str = "draft_model"
    num_speculative_tokens: int = 4
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    synthetic_acceptance_length: float | None = None
    draft_sample_method: str = "greedy"
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    use_heterogeneous_vocab: bool = False
    kv_cache_dtype: str | None = None
    verify_impl: str = "auto"
    speculative_token_tree: tuple[tuple[int, ...], ...] | None = None
    total_tokens: int | str | None = None
    top_k: int | None = None
    dflash_full_block: bool | None = None
    dspark_draft_topk: int | None = None
    mtp_hidden_state: str | None = None
    enable_adaptive_verification: bool = False
    adaptive_verify_widths: tuple[int, ...] | None = None

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """The verify widths compiled into the loop: adaptive_verify_widths (or its default) with adaptive
        verification, else K alone."""
        k = self.num_speculative_tokens
        if not self.enable_adaptive_verification:
            return (k,)
        if self.adaptive_verify_widths is not None:
            return self.adaptive_verify_widths
        return (0, *(1 << i for i in range(k.bit_length()) if 1 << i < k), k)

    @property
    def auto_tree_sizes(self) -> tuple[int, ...]:
        """The sizes `total_tokens: auto` chooses from: those of AUTO_TREE_SIZES that top_k over the depth
        fills (top_k + (depth - 1) * top_k^2 candidates), or that number alone when none fits."""
        most = self.top_k + (self.num_speculative_tokens - 1) * self.top_k ** 2
        return tuple(size for size in AUTO_TREE_SIZES if size <= most) or (most,)

    @property
    def num_draft_nodes(self) -> int:
        """Drafts scored per step: the tree's nodes (the largest size `auto` may choose), or K for a chain."""
        if self.total_tokens == "auto":
            return self.auto_tree_sizes[-1]
        if self.total_tokens is not None:
            return self.total_tokens
        return self.num_speculative_tokens if self.speculative_token_tree is None else len(self.speculative_token_tree)

    @property
    def drafts_tree(self) -> bool:
        """Whether each step drafts a tree (static or dynamic) rather than a chain."""
        return self.speculative_token_tree is not None or self.total_tokens is not None

    def __post_init__(self):
        require_positive_ints(self, "num_speculative_tokens", "prompt_lookup_min")
        k = self.num_speculative_tokens
        if self.speculative_token_tree is not None:
            object.__setattr__(self, "speculative_token_tree", check_token_tree(self.speculative_token_tree, k))
            require(self.rejection_sample_method in TREE_REJECTION_SAMPLE_METHODS, "SpecConfig",
                    "rejection_sample_method", self.rejection_sample_method,
                    f"one of {TREE_REJECTION_SAMPLE_METHODS} with speculative_token_tree")
        if (self.total_tokens is None) != (self.top_k is None):
            raise ConfigError(f"SpecConfig.total_tokens = {self.total_tokens!r} and top_k = {self.top_k!r}: allowed "
                              "both (a dynamic draft tree) or neither")
        if self.total_tokens is not None:
            require_positive_ints(self, "top_k")
            if self.total_tokens != "auto":
                require(isinstance(self.total_tokens, int) and not isinstance(self.total_tokens, bool)
                        and self.total_tokens > 0, "SpecConfig", "total_tokens", self.total_tokens,
                        "a positive integer or 'auto'")
            require(self.speculative_token_tree is None, "SpecConfig", "total_tokens", self.total_tokens,
                    "None with speculative_token_tree (a tree is static or dynamic, not both)")
            candidates = self.top_k + (k - 1) * self.top_k ** 2
            require(self.num_draft_nodes <= candidates, "SpecConfig", "total_tokens", self.total_tokens,
                    f"at most the {candidates} candidates that top_k {self.top_k} over num_speculative_tokens {k} "
                    "depths makes (top_k + (depth - 1) * top_k^2)")
            require(self.rejection_sample_method in TREE_REJECTION_SAMPLE_METHODS, "SpecConfig",
                    "rejection_sample_method", self.rejection_sample_method,
                    f"one of {TREE_REJECTION_SAMPLE_METHODS} with a dynamic tree")
            require(self.draft_sample_method == "greedy", "SpecConfig", "draft_sample_method", self.draft_sample_method,
                    "'greedy' with a dynamic tree: its drafts are each node's top-k, chosen by their own "
                    "probabilities, which a sampled tree's verification cannot condition on")
        require(self.draft_sample_method in DRAFT_SAMPLE_METHODS, "SpecConfig", "draft_sample_method",
                self.draft_sample_method, f"one of {DRAFT_SAMPLE_METHODS}")
        require(self.verify_impl in VERIFY_IMPLS, "SpecConfig", "verify_impl", self.verify_impl,
                f"one of {VERIFY_IMPLS}")
        require(isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
                "SpecConfig", "prompt_lookup_max", self.prompt_lookup_max,
                f"an integer >= prompt_lookup_min ({self.prompt_lookup_min})")
        if self.kv_cache_dtype is not None:
            dtype_from_name(self.kv_cache_dtype, "SpecConfig.kv_cache_dtype")
        require(self.dflash_full_block is None or (isinstance(self.dflash_full_block, bool)
                                                   and (not self.dflash_full_block or self.method in BLOCK_METHODS)),
                "SpecConfig", "dflash_full_block", self.dflash_full_block,
                f"null (auto), true or false with method 'dflash' or 'dspark'; null or false with method "
                f"{self.method!r}")
        topk = self.dspark_draft_topk
        require(topk is None or (self.method == "dspark" and isinstance(topk, int) and not isinstance(topk, bool)
                                 and topk >= 1), "SpecConfig", "dspark_draft_topk", topk,
                f"null, or an integer >= 1 with method 'dspark' (method is {self.method!r})")
        require(self.mtp_hidden_state is None or (self.mtp_hidden_state in ("chained", "target")
                                                  and self.method == "mtp"),
                "SpecConfig", "mtp_hidden_state", self.mtp_hidden_state,
                f"null (the checkpoint's), 'chained' or 'target' with method 'mtp'; null with method {self.method!r}")
        self.check_adaptive()
        if self.use_heterogeneous_vocab and (self.method != "draft_model" or self.draft_sample_method != "greedy"):
            raise ConfigError(
                f"SpecConfig.use_heterogeneous_vocab = True with method {self.method!r} and draft_sample_method "
                f"{self.draft_sample_method!r} is invalid: allowed only with method 'draft_model' and "
                "draft_sample_method 'greedy'")
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        if self.rejection_sample_method != "synthetic":
            if rates is not None or length is not None:
                raise ConfigError(
                    f"SpecConfig.rejection_sample_method = {self.rejection_sample_method!r} cannot be combined "
                    "with synthetic_acceptance_rates / synthetic_acceptance_length: allowed only with "
                    "rejection_sample_method 'synthetic'")
            return
        if (rates is None) == (length is None):
            raise ConfigError("SpecConfig with rejection_sample_method 'synthetic' needs exactly one of "
                              f"synthetic_acceptance_rates (got {rates!r}) and synthetic_acceptance_length "
                              f"(got {length!r})")
        if rates is not None:
            object.__setattr__(self, "synthetic_acceptance_rates", tuple(float(r) for r in rates))
            rates = self.synthetic_acceptance_rates
            require(len(rates) == k, "SpecConfig", "synthetic_acceptance_rates", rates,
                     f"{k} values (one per draft position, num_speculative_tokens = {k})")
            require(all(0.0 <= r <= 1.0 for r in rates), "SpecConfig", "synthetic_acceptance_rates", rates,
                     "values in [0, 1]")
            require(all(a >= b for a, b in zip(rates, rates[1:])), "SpecConfig", "synthetic_acceptance_rates",
                     rates, "non-increasing values (position i cannot be accepted more often than i - 1)")
        else:
            require(1.0 <= length <= k + 1, "SpecConfig", "synthetic_acceptance_length", length,
                     f"a mean acceptance length in [1, num_speculative_tokens + 1 = {k + 1}]")

    def check_adaptive(self) -> None:
        adaptive, widths, k = self.enable_adaptive_verification, self.adaptive_verify_widths, self.num_speculative_tokens
        require(isinstance(adaptive, bool), "SpecConfig", "enable_adaptive_verification", adaptive, "true or false")
        if adaptive and self.drafts_tree:
            field = "speculative_token_tree" if self.speculative_token_tree is not None else "total_tokens"
            raise ConfigError(f"SpecConfig.enable_adaptive_verification = True with {field} = "
                              f"{getattr(self, field)!r} is invalid: adaptive verification cuts chains (allowed: "
                              f"enable_adaptive_verification with {field} = null)")
        if widths is None:
            return
        require(adaptive, "SpecConfig", "adaptive_verify_widths", widths,
                "null without enable_adaptive_verification = true")
        ok = (isinstance(widths, (tuple, list)) and all(isinstance(w, int) and not isinstance(w, bool) for w in widths)
              and len(widths) > 0 and list(widths) == sorted(set(widths)) and widths[0] >= 0 and widths[-1] == k)
        require(ok, "SpecConfig", "adaptive_verify_widths", widths,
                f"null, or increasing integers in 0..num_speculative_tokens ending with it ({k})")
        object.__setattr__(self, "adaptive_verify_widths", tuple(widths))

    @property
    def synthetic_rates(self) -> tuple[float, ...]:
        """Unconditional per-position acceptance rates: given, or from the mean length L as vLLM does
        (floor(L - 1) ones, then the fractional part, then zeros; their sum is L - 1)."""
        if self.synthetic_acceptance_rates is not None:
            return self.synthetic_acceptance_rates
        extra = self.synthetic_acceptance_length - 1.0
        whole = int(extra)
        rates = [1.0] * whole + [extra - whole]
        return tuple((rates + [0.0] * self.num_speculative_tokens)[:self.num_speculative_tokens])


# ----------------------------------------------------------------------------------------- YAML files

def from_dict(cls, data: dict, where: str):
    """Builds the (possibly nested) frozen dataclass cls from a mapping, strictly: an unknown key, a
    missing required key or a value of the wrong type is a ConfigError naming the key, `where` (the
    file) and what is allowed."""
    import typing

    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} in {cls.__name__}: allowed {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        values[name] = _convert(hints[name], value, f"{where}: {cls.__name__}.{name}")
    missing = [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: {cls.__name__} is missing required key {missing[0]!r}")
    try:
        return cls(**values)
    except ConfigError as error:  # the class's own checks: say which file
        raise ConfigError(f"{where}: {error}") from error


def _convert(hint, value, where: str):
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, where)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where.split(":")[0])
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} = {value!r} is invalid: allowed a list")
        item = args[0] if args else typing.Any
        return tuple(_convert(item, v, where) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} = {value!r} is invalid: allowed a mapping")
        return {_convert(args[0], k, where): _convert(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} = {value!r} is invalid: allowed a list")
        return [_convert(args[0], v, where) for v in value] if args else list(value)
    if hint is typing.Any:
        return value
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where} = {value!r} is invalid: allowed one of {list(args)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} = {value!r} is invalid: allowed a number")
        return float(value)
    if hint in (int, str, bool) and not (isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
        kind = {int: "an integer", str: "a string", bool: "true or false"}[hint]
        raise ConfigError(f"{where} = {value!r} is invalid: allowed {kind}")
    return value


def load_yaml(cls, path, overrides=()):
    """A config from a YAML file with `key.sub=value` overrides (values parsed as YAML; the command line's
    --set). Malformed YAML and keys no field has are one-line ConfigErrors naming the file or the --set."""
    from pathlib import Path

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    data = parse_yaml(path.read_text(), str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of {cls.__name__}'s fields, got {type(data).__name__}")
    data = with_overrides(cls, data, overrides)
    return from_dict(cls, data, str(path) + (f" with --set {' '.join(overrides)}" if overrides else ""))


def with_overrides(cls, data: dict, overrides=()) -> dict:
    """data (a mapping of cls's fields, changed in place) with `key.sub=value` overrides (values parsed as
    YAML; the command line's --set); a key no field of cls has is a ConfigError naming the --set."""
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep:
            raise ConfigError(f"--set {override!r} is invalid: allowed key=value (e.g. optimizer.lr=3e-4)")
        check_field_path(cls, key, f"--set {override}")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):  # absent or null: the override starts the mapping
                node[part] = {}
            node = node[part]
        node[leaf] = parse_yaml(raw, f"--set {override}")
    return data


def parse_yaml(text: str, where: str):
    """YAML text parsed; a syntax error is a ConfigError naming where, the line and column and the problem."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = ": ".join(filter(None, (getattr(error, "context", None), getattr(error, "problem", None))))
        raise ConfigError(f"{where}: malformed YAML{at}: {problem or error}") from None


def check_field_path(cls, key: str, where: str) -> None:
    """A ConfigError naming `where` unless the dotted key names a field of cls's (nested) dataclasses; below
    a field that is no dataclass (e.g. a sweep's grid mapping) any key goes."""
    import typing

    node = cls
    for depth, part in enumerate(key.split(".")):
        if not dataclasses.is_dataclass(node):
            return
        fields = {f.name for f in dataclasses.fields(node)}
        if part not in fields:
            inside = ".".join(key.split(".")[:depth])
            raise ConfigError(f"{where}: unknown key {part!r}{f' in {inside}' if inside else ''} "
                              f"({node.__name__}): allowed {sorted(fields)}")
        hint = typing.get_type_hints(node)[part]
        options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        node = next((a for a in options if dataclasses.is_dataclass(a)), options[0])


# -------------------------------------------------------------------------------------------- training

@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Corpus, tokenizer and batches. corpus_dir None is the running interpreter's standard library
    (tests excluded); tokenizer None trains a byte-level BPE of vocab_size on the training split."""

    corpus_dir: str | None = None
    pattern: str = "*.py"
    max_files: int | None = None  # the first N files in path order (quick runs, tests)
    held_out_fraction: float = 0.05
    tokenizer: str | None = None
    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 32
    # Where the prepared corpus (tokenizer/ and token files) lives, e.g. the target run's folder to
    # reuse its tokenization; prepared there when absent. None: the run's output_dir.
    cache_dir: str | None = None

    def __post_init__(self):
        require(0.0 < self.held_out_fraction < 1.0, "DataConfig", "held_out_fraction", self.held_out_fraction,
                "a float in (0, 1)")
        require_positive_ints(self, "seq_len", "batch_size", "vocab_size")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup and cosine decay to min_lr_ratio * lr, global-norm clipping."""

    lr: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0

    def __post_init__(self):
        require_positive_ints(self, "total_steps")
        require(0 <= self.warmup_steps <= self.total_steps, "OptimizerConfig", "warmup_steps", self.warmup_steps,
                f"an integer in [0, total_steps = {self.total_steps}]")
        require(self.lr > 0, "OptimizerConfig", "lr", self.lr, "a float > 0")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """A (data, model) device mesh (specjax.sharding): data=-1 takes every device the model axis leaves."""

    data: int = -1
    model: int = 1

    def __post_init__(self):
        require(self.data == -1 or self.data >= 1, "MeshConfig", "data", self.data, "-1 or an integer >= 1")
        require_positive_ints(self, "model")


# Dtypes a training run may compute in (TrainingRun.compute_dtype).
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingRun:
    """What every training run has: data, optimizer, where it writes, how often it saves and logs."""

    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    output_dir: str = "runs/train"
    seed: int = 0
    checkpoint_every: int = 200
    log_every: int = 10
    # Devices: batches split over mesh.data; weights split over mesh.model by specjax.sharding's rules
    # and, with fsdp, also over mesh.data (each device keeps a slice of weights and optimizer state).
    mesh: MeshConfig = MeshConfig()
    fsdp: bool = False
    # Rematerialisation of the trained module's layers (and the frozen target's, which has no backward
    # pass and is unaffected): ModelConfig.remat's policies, REMAT_POLICIES.
    remat: str = "none"
    # Each step's batch runs as grad_accum_steps micro-batches of data.batch_size / grad_accum_steps rows
    # (a lax.scan inside the step) whose gradients are averaged: the big batch's step in less memory.
    grad_accum_steps: int = 1
    # The dtype activations and matrix products of the trained module and of the frozen target run in
    # ('bfloat16', 'float16', 'float32'); the trained weights and optimizer state stay float32 (master
    # weights). None: the module's own config decides (an LM's model.dtype, a head's its target's).
    compute_dtype: str | None = None

    def __post_init__(self):
        require_positive_ints(self, "checkpoint_every", "log_every", "grad_accum_steps")
        name = type(self).__name__
        require(self.remat in REMAT_POLICIES, name, "remat", self.remat, f"one of {list(REMAT_POLICIES)}")
        require(self.data.batch_size % self.grad_accum_steps == 0, name, "grad_accum_steps", self.grad_accum_steps,
                f"a divisor of data.batch_size ({self.data.batch_size})")
        require(self.compute_dtype in (None, *COMPUTE_DTYPES), name, "compute_dtype", self.compute_dtype,
                f"None or one of {list(COMPUTE_DTYPES)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(TrainingRun):
    """One LM training run; everything it writes goes under output_dir."""

    model: ModelConfig
    eval_batches: int = 16

    def __post_init__(self):
        super().__post_init__()
        # One place for the policy: the run's remat, which train_lm writes into the model's config.
        require(self.model.remat == "none", "TrainConfig", "model.remat", self.model.remat,
                "'none' (set the run's remat instead)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadTrainConfig(TrainingRun):
    """Training draft heads (EAGLE or Medusa) on a frozen target."""

    # The target's Hugging Face folder or default:target (its tokenizer tokenizes the corpus).
    target: str
    kind: Literal["eagle1", "eagle3", "medusa"]
    # Medusa: heads, residual blocks per head, and whether heads project with the target's LM head
    # instead of a copy each.
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = False
    # EAGLE-3: the target layers whose inputs are fused, three distinct ones (None: layers 2, L//2, L-3, or on
    # targets under 7 layers, where that repeats one, 1, L//2, L-1: models.eagle.default_fuse_layers).
    fuse_layers: tuple[int, ...] | None = None
    # EAGLE-1 or EAGLE-3: the most frequent training ids that drafts are drawn from (None: the target's
    # vocabulary). EAGLE-3 trains its own LM head over them; EAGLE-1 is trained as without one and
    # drafts with those rows of the target's LM head (FR-Spec).
    draft_vocab_size: int | None = None
    # EAGLE-3's training-time test (draft steps fed their own output, loss weights step_decay^i) and
    # Medusa's per-head loss weights (step_decay^k).
    unroll_steps: int = 7
    step_decay: float = 0.8
    # EAGLE-1's uniform noise on target features.
    feature_noise: float = 0.1
    # The closing acceptance eval: held-out prompts, greedy, K = eval_num_speculative_tokens.
    eval_prompts: int = 32
    eval_prompt_len: int = 64
    eval_new_tokens: int = 64
    eval_num_speculative_tokens: int = 4

    def __post_init__(self):
        super().__post_init__()
        require(self.kind in ("eagle1", "eagle3", "medusa"), "HeadTrainConfig", "kind", self.kind,
                "'eagle1', 'eagle3' or 'medusa'")
        require(0.0 < self.step_decay <= 1.0, "HeadTrainConfig", "step_decay", self.step_decay, "a float in (0, 1]")
        require(self.fuse_layers is None or self.kind == "eagle3", "HeadTrainConfig", "fuse_layers",
                self.fuse_layers, f"only with kind 'eagle3' (kind is {self.kind!r}), else None")
        require(self.fuse_layers is None or len(set(self.fuse_layers)) == len(self.fuse_layers) == 3,
                "HeadTrainConfig", "fuse_layers", self.fuse_layers,
                "None or three distinct target layers (a repeated layer adds no information to the fused feature)")
        require(self.draft_vocab_size is None or self.kind in ("eagle1", "eagle3"), "HeadTrainConfig",
                "draft_vocab_size", self.draft_vocab_size,
                f"only with kind 'eagle1' or 'eagle3' (kind is {self.kind!r}), else None")
        require(self.draft_vocab_size is None or (isinstance(self.draft_vocab_size, int)
                                                  and self.draft_vocab_size >= 1),
                "HeadTrainConfig", "draft_vocab_size", self.draft_vocab_size, "None or an integer >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OwnTextTrainingRun(TrainingRun):
    """What drafters trained on the target's own text share (DFlash, MTP): the target, the distillation mix,
    the regenerated sequences and the closing eval's prompts."""

    # The target's Hugging Face folder or default:target (its tokenizer tokenizes the corpus).
    target: str
    # 0: cross-entropy against the sequence's tokens (the recipes'); 1: against the target's distribution
    # of the same tokens (distillation); between: the mix.
    distill_weight: float = 0.0
    # 0: train on corpus windows. N > 0: on N sequences the target writes itself (EAGLE-3's and DFlash's
    # "data regenerated by the target"): a corpus window of regenerate_prompt_len tokens continued by the
    # target to data.seq_len + 1 tokens, at regenerate_temperature (0: greedy). Saved as regenerated.npy.
    regenerate_sequences: int = 0
    regenerate_prompt_len: int = 32
    regenerate_temperature: float = 0.0
    # The closing acceptance eval: held-out prompts, greedy.
    eval_prompts: int = 32
    eval_prompt_len: int = 64
    eval_new_tokens: int = 64

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        require_positive_ints(self, "eval_prompts", "eval_prompt_len", "eval_new_tokens")
        require(self.regenerate_sequences >= 0, name, "regenerate_sequences", self.regenerate_sequences,
                "an integer >= 0 (0: train on the corpus)")
        require(1 <= self.regenerate_prompt_len <= self.data.seq_len, name, "regenerate_prompt_len",
                self.regenerate_prompt_len, f"an integer in [1, data.seq_len = {self.data.seq_len}]")
        require(self.regenerate_temperature >= 0.0, name, "regenerate_temperature", self.regenerate_temperature,
                "a float >= 0 (0: greedy)")
        require(0.0 <= self.distill_weight <= 1.0, name, "distill_weight", self.distill_weight, "a float in [0, 1]")


# The recipe's loss decay for a block size (DFlash, SpecForge): gamma 7 for 16, 5 for 10, 4 for 8.
DFLASH_LOSS_DECAY = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashTrainConfig(OwnTextTrainingRun):
    """Training a DFlash block drafter on a frozen target (specjax.training.dflash)."""

    # Drafter layers: Qwen3 layers of the target's width, heads and head size.
    num_layers: int = 1
    # The drafter's MLP width (None: the target's); narrower layers buy depth within a size budget.
    intermediate_size: int | None = None
    # Target layers whose outputs make the context feature (None: spread from 1 to L - 3, as z-lab's).
    target_layer_ids: tuple[int, ...] | None = None
    # The block: the anchor and block_size - 1 masked slots, each predicting the token at its position.
    block_size: int = 16
    causal: bool = False
    # The token that fills the masked slots (None: the target's pad_token_id, else its last id).
    mask_token_id: int | None = None
    # Blocks per training sequence, at distinct random anchors whose whole block lies inside it.
    num_anchors: int = 32
    # Weight of block slot k >= 1: exp(-(k - 1) / loss_decay_gamma) (None: DFLASH_LOSS_DECAY, else 7).
    loss_decay_gamma: float | None = None
    # The closing eval's K (None: block_size - 1).
    eval_num_speculative_tokens: int | None = None

    def __post_init__(self):
        super().__post_init__()
        require_positive_ints(self, "num_layers", "num_anchors")
        require(self.block_size >= 2, "DFlashTrainConfig", "block_size", self.block_size, "an integer >= 2")
        require(self.intermediate_size is None
                or (isinstance(self.intermediate_size, int) and self.intermediate_size >= 1),
                "DFlashTrainConfig", "intermediate_size", self.intermediate_size, "None or an integer >= 1")
        require(self.data.seq_len >= self.block_size, "DFlashTrainConfig", "data.seq_len", self.data.seq_len,
                f"an integer >= block_size ({self.block_size}): every block lies inside its sequence")
        require(self.loss_decay_gamma is None or self.loss_decay_gamma > 0, "DFlashTrainConfig", "loss_decay_gamma",
                self.loss_decay_gamma, "None or a float > 0")
        k = self.eval_num_speculative_tokens
        require(k is None or 1 <= k <= self.block_size - 1, "DFlashTrainConfig", "eval_num_speculative_tokens", k,
                f"None or an integer in [1, block_size - 1 = {self.block_size - 1}]")

    @property
    def decay_gamma(self) -> float:
        return self.loss_decay_gamma or DFLASH_LOSS_DECAY.get(self.block_size, 7.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DSparkTrainConfig(DFlashTrainConfig):
    """Training a DSpark drafter (specjax.models.dspark): DFlashTrainConfig's backbone and recipe, with the
    Markov head trained jointly and the confidence head on the acceptance each block observes
    (specjax.training.dflash; `specjax train-dspark`)."""

    # The Markov head's rank (0: none, a DFlash drafter in DSpark's layout) and type.
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    # The anchor's slot drafts the first token (DeepSpec's layout); False: the slot after it (DFlash's).
    sample_from_anchor: bool = True
    # Weight of the confidence head's loss (DeepSpec's name; 0: no confidence head).
    confidence_head_alpha: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        require(isinstance(self.markov_rank, int) and not isinstance(self.markov_rank, bool) and self.markov_rank >= 0,
                "DSparkTrainConfig", "markov_rank", self.markov_rank, "an integer >= 0 (0: no Markov head)")
        require(self.markov_head_type in ("vanilla", "gated"), "DSparkTrainConfig", "markov_head_type",
                self.markov_head_type, "'vanilla' or 'gated'")
        require(self.confidence_head_alpha >= 0, "DSparkTrainConfig", "confidence_head_alpha",
                self.confidence_head_alpha, "a float >= 0 (0: no confidence head)")
        span = self.block_size + self.sample_from_anchor  # the anchor's slot predicts the token after it
        require(self.data.seq_len >= span, "DSparkTrainConfig", "data.seq_len", self.data.seq_len,
                f"an integer >= {span} (block_size{' + 1 with sample_from_anchor' if self.sample_from_anchor else ''}):"
                " every block's labels lie inside its sequence")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MTPTrainConfig(OwnTextTrainingRun):
    """Training multi-token prediction modules on a frozen target (specjax.training.mtp)."""

    # Modules: module m (0-based) predicts the token m + 2 after each position (specjax.models.mtp).
    num_modules: int = 1
    # The modules' MLP width (None: the target's).
    intermediate_size: int | None = None
    # What feeds module m > 0, 'chained' or 'target' (specjax.models.mtp); the saved default of decoding.
    hidden_state: str = "chained"
    # DeepSeek-V3's loss over depths: sum over modules of weight_m * cross-entropy_m; None: 1 / num_modules each.
    loss_weights: tuple[float, ...] | None = None
    # The closing eval's K (None: num_modules).
    eval_num_speculative_tokens: int | None = None

    def __post_init__(self):
        super().__post_init__()
        name = "MTPTrainConfig"
        require_positive_ints(self, "num_modules")
        require(self.intermediate_size is None
                or (isinstance(self.intermediate_size, int) and self.intermediate_size >= 1),
                name, "intermediate_size", self.intermediate_size, "None or an integer >= 1")
        require(self.hidden_state in ("chained", "target"), name, "hidden_state", self.hidden_state,
                "'chained' or 'target'")
        weights = self.loss_weights
        require(weights is None or (len(weights) == self.num_modules and all(w >= 0 for w in weights)
                                    and sum(weights) > 0), name, "loss_weights", weights,
                f"None or {self.num_modules} non-negative weights (one per module), not all 0")
        require(self.data.seq_len >= self.num_modules + 2, name, "data.seq_len", self.data.seq_len,
                f"an integer >= num_modules + 2 ({self.num_modules + 2}): the last module's labels lie inside it")
        k = self.eval_num_speculative_tokens
        require(k is None or (isinstance(k, int) and k >= 1), name, "eval_num_speculative_tokens", k,
                "None or an integer >= 1")

    @property
    def depth_weights(self) -> tuple[float, ...]:
        return self.loss_weights or (1.0 / self.num_modules,) * self.num_modules

"""Decoder-only transformer LM in functional Flax NNX: the Llama / Qwen2 / Qwen3 / Mistral family and GPT-2.

The call is pure: `model(tokens, positions, cache) -> (logits, hidden, new_cache)` mutates nothing and
returns a new cache, so the model (an NNX module, hence a pytree) goes straight into `jax.jit` and a
`lax.while_loop` carry. Layer weights are stacked on a leading layer axis and the layers run as one
`lax.scan`, which keeps compile time flat in depth and lines the weights up with the cache's layer axis.

Decoding wants another layout: on the GPU, XLA copies each layer's slice of a stacked weight into a
buffer of its own before the matrix product reads it, so a memory-bound decode step would read every
weight three times (docs/performance.md). `to_decoding_layout(model)` gives the same model in the
decoding layout (`DecodingLayer`: per-layer arrays, q/k/v and gate/up fused, decode steps writing the
cache and attending through the Pallas kernel `pallas_kernels.decode_attention` on a GPU), run as a
Python loop over layers: `for_decoding` takes it where it pays (GPUs, layers large enough), and
`experiments.load_models` and `specjax generate` decode through `for_decoding`; training, checkpoints
and converters keep the stacked layout.

Dimension names in shapes and einsum strings: B batch, T new tokens, S cache slots, D hidden size,
H query heads, K key/value heads, G query heads per KV head (H = K * G), E head dim, F MLP width,
V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Bool, Float, Int

from specjax.config import ModelConfig, matmul_precision_for
from specjax.models.kv_cache import KVCache
from specjax.pallas_kernels import decode_attention


@functools.partial(jax.tree_util.register_dataclass, data_fields=("final", "layers"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class Hidden:
    """Hidden states of a forward pass.

    final: the last layer's output after the final norm (what the LM head reads; EAGLE and Medusa's
      feature). layers: the residual stream entering each layer asked for in `hidden_layers`
      (index i < L is the input of layer i, index L the last layer's output before the final norm),
      stacked as [len(hidden_layers), B, T, D]; None when none was asked for.
    """

    final: Float[Array, "B T D"]
    layers: Float[Array, "N B T D"] | None


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair rotation frequencies [E/2], with Llama-3 or linear scaling applied (float64, host)."""
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = old_context / scaling.low_freq_factor
    high_freq_wavelength = old_context / scaling.high_freq_factor
    scaled = np.where(wavelength > low_freq_wavelength, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return np.where(in_band, blended, scaled)


def apply_rope(x: Float[Array, "B T N E"], positions: Int[Array, "B T"], inv_freq: np.ndarray):
    """Rotates pairs (i, i + E/2) of each head by position * frequency (the rotate-half convention)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # [B, T, E/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    first, second = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


# The name einsum_f32 gives its products without batch dimensions on accelerators, for remat 'dots' to save them.
UNBATCHED_PRODUCT = "einsum_f32_unbatched"


def einsum_f32(spec: str, a: Array, b: Array) -> Array:
    """einsum with a float32 result, accumulated in float32 from low-precision inputs. XLA's CPU dot
    runtime lacks some bf16 x bf16 -> f32 forms (batched ones fail: "Unsupported element type for
    DotThunk"), so on the CPU the inputs are upcast first; GPUs and TPUs do it natively, and there the
    gradient of bfloat16 inputs is a bfloat16 product's (_einsum_f32_low_precision_grads)."""
    if jax.default_backend() == "cpu":
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
    if a.dtype == b.dtype and jnp.issubdtype(a.dtype, jnp.floating) and jnp.finfo(a.dtype).bits < 32:
        product = _einsum_f32_low_precision_grads(spec, a, b)
        # remat 'dots' saves products without batch dimensions; it cannot see this one inside its custom_vjp.
        inputs, _, output = spec.replace(" ", "").partition("->")
        lhs, rhs = inputs.split(",")
        batched = not output or set(lhs) & set(rhs) & set(output) - {"."}  # implicit output: left unnamed
        return product if batched else checkpoint_name(product, UNBATCHED_PRODUCT)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_f32_low_precision_grads(spec: str, a: Array, b: Array) -> Array:
    """einsum_f32 whose backward products take the cotangent in the inputs' dtype, as a low-precision
    einsum's do: JAX's own transpose would multiply the float32 cotangent by a bfloat16 input, which XLA
    runs as a float32 (TF32) product at half the bfloat16 rate."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _einsum_f32_forward(spec, a, b):
    return _einsum_f32_low_precision_grads(spec, a, b), (a, b)


def _einsum_f32_backward(spec, inputs, cotangent):
    a, b = inputs
    cotangent = cotangent.astype(a.dtype)
    da, = jax.linear_transpose(lambda a: jnp.einsum(spec, a, b), a)(cotangent)
    db, = jax.linear_transpose(lambda b: jnp.einsum(spec, a, b), b)(cotangent)
    return da, db


_einsum_f32_low_precision_grads.defvjp(_einsum_f32_forward, _einsum_f32_backward)


def normalize(x: Float[Array, "... D"], scale, bias, config: ModelConfig):
    """RMSNorm (bias None) or LayerNorm, computed in float32 and returned in x's dtype."""
    xf = x.astype(jnp.float32)
    if config.norm == "layer":
        xf = xf - xf.mean(-1, keepdims=True)
    xf = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + config.norm_eps)
    out = xf.astype(x.dtype) * scale.astype(x.dtype)
    return out if bias is None else out + bias.astype(x.dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("sees",), meta_fields=())
@dataclasses.dataclass(frozen=True)
class NewTokenMask:
    """Which slots the new tokens of a call see, given among themselves: new token t sees new token j where
    sees[b, t, j], and every slot before the row's first new slot (the committed cache). A draft tree's
    verification block (masks.tree_mask); the decoding layout's Pallas kernel takes it as it is,
    XLA as the dense [B, T, S] mask (`dense`)."""
    sees: Bool[Array, "B T M"]

    def dense(self, first_slots: Int[Array, " B"], cache_size: int) -> Bool[Array, "B T S"]:
        """The [B, T, S] mask with the M slots of the block starting at first_slots[b]."""
        batch, num_queries, block = self.sees.shape
        offset = jnp.arange(cache_size)[None, :] - first_slots[:, None]  # [B, S]: the slot's index in the block
        index = jnp.broadcast_to(jnp.clip(offset, 0, block - 1)[:, None, :], (batch, num_queries, cache_size))
        sees_block = jnp.take_along_axis(self.sees, index, axis=2)
        return (offset < 0)[:, None, :] | (sees_block & (offset < block)[:, None, :])


def attention(q: Float[Array, "B T H E"], k: Float[Array, "B S K E"], v: Float[Array, "B S K E"],
              query_slots: Int[Array, "B T"], config: ModelConfig, *, causal: bool = True,
              visible: Bool[Array, "B T S"] | None = None) -> Float[Array, "B T H E"]:
    """GQA attention by cache slot: the query at slot t sees slots <= t (optionally within the sliding
    window), or with causal=False every slot up to its row's last query slot (the new tokens see one
    another: a DFlash draft block); `visible`, when given, is the mask itself.

    Slots past a row's fill level are never visible: every query slot is below lengths + T, and slots
    between are exactly the ones written by this call.
    """
    batch, num_new, _, head_dim = q.shape
    q = q.reshape(batch, num_new, config.num_kv_heads, config.num_query_groups, head_dim)
    scores = einsum_f32("btkge,bske->bkgts", q, k)
    scores = scores / math.sqrt(head_dim)
    if visible is None:
        key_slots = jnp.arange(k.shape[1])[None, None, :]
        limits = query_slots if causal else jnp.broadcast_to(query_slots.max(axis=1, keepdims=True), query_slots.shape)
        visible = key_slots <= limits[:, :, None]  # [B, T, S]
        if config.sliding_window is not None:
            visible &= key_slots > query_slots[:, :, None] - config.sliding_window
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bske->btkge", probs, v)
    return out.reshape(batch, num_new, config.num_heads, head_dim)


# cuDNN's flash attention takes these dtypes and head sizes (jax.nn.dot_product_attention refuses others).
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128


def full_attention_impl(config: ModelConfig) -> str:
    """jax.nn.dot_product_attention's implementation for config's full causal forward ('cudnn' or 'xla'):
    config.attention_impl, with 'auto' cuDNN on GPUs where it applies (see ModelConfig.attention_impl)."""
    if config.attention_impl != "auto":
        return config.attention_impl
    cudnn_fits = (config.jnp_dtype in CUDNN_DTYPES and config.head_dim % 8 == 0
                  and config.head_dim <= CUDNN_MAX_HEAD_DIM and config.sliding_window is None)
    return "cudnn" if jax.default_backend() == "gpu" and cudnn_fits else "xla"


def full_causal_attention(q: Float[Array, "B T H E"], k: Float[Array, "B T K E"], v: Float[Array, "B T K E"],
                          config: ModelConfig) -> Float[Array, "B T H E"]:
    """Causal GQA attention of T tokens among themselves (no cache, no mask) through
    jax.nn.dot_product_attention: cuDNN's flash attention keeps no [T, T] scores for the backward pass.
    Equal to `attention` with query slots 0..T-1, sliding window included."""
    impl = full_attention_impl(config)
    window = None if config.sliding_window is None else (config.sliding_window - 1, 0)
    dtype = q.dtype
    if impl == "xla" and jax.default_backend() == "cpu" and dtype != jnp.float32:
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))  # the CPU's dot lacks bf16 -> f32 (einsum_f32)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window, implementation=impl)
    return out.astype(dtype)


def checkpointed(step, config: ModelConfig):
    """step (a function of pytrees) rematerialised by config.remat: as is for 'none'; for 'layer' only its
    inputs are kept for the backward pass; for 'dots' also the results of products without batch dimensions
    (the weight products), so that only the elementwise work and attention are recomputed."""
    if config.remat == "none":
        return step
    policies = jax.checkpoint_policies
    policy = (policies.save_from_both_policies(policies.dots_with_no_batch_dims_saveable,
                                               policies.save_only_these_names(UNBATCHED_PRODUCT))
              if config.remat == "dots" else None)
    return jax.checkpoint(step, prevent_cse=False, policy=policy)  # prevent_cse is not needed inside a scan


def precision_scope(config: ModelConfig):
    """The context a model's products run in: config's matmul precision (ModelConfig.matmul_precision)."""
    return jax.default_matmul_precision(config.resolved_matmul_precision)


def at_model_precision(method):
    """A module method run in its model's precision_scope: the module's config is a ModelConfig, has one as
    `layer` (draft heads), or names only a compute `dtype` ('auto' precision for it; Medusa's heads)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        config = self.config if isinstance(self.config, ModelConfig) else getattr(self.config, "layer", None)
        scope = (precision_scope(config) if config is not None
                 else jax.default_matmul_precision(matmul_precision_for(self.config.dtype)))
        with scope:
            return method(self, *args, **kwargs)
    return run


def init_param(rngs: nnx.Rngs, shape, config: ModelConfig, kind: str = "normal") -> nnx.Param:
    dtype = config.jnp_param_dtype
    if kind == "ones":
        return nnx.Param(jnp.ones(shape, dtype))
    if kind == "zeros":
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param(config.init_std * jax.random.normal(rngs.params(), shape, dtype))


class StackedLayers(nnx.Module):
    """Every decoder layer's weights, stacked on a leading L axis. Absent weights (biases, the gate of
    a GELU MLP, LayerNorm shifts, the per-head q / k norms of all but Qwen3) are None."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, attn_input_size: int | None = None):
        c = config
        L, D, H, K, E, F = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                            c.intermediate_size)
        D_in = attn_input_size or D  # EAGLE-3 projects q, k, v from [embedding, feature] (2D)

        def weight(*shape):
            return init_param(rngs, (L, *shape), c)

        def bias(present: bool, *shape):
            return init_param(rngs, (L, *shape), c, "zeros") if present else None

        layer_norm = c.norm == "layer"
        self.attn_norm = init_param(rngs, (L, D), c, "ones")
        self.attn_norm_bias = bias(layer_norm, D)
        self.wq, self.wk, self.wv = weight(D_in, H, E), weight(D_in, K, E), weight(D_in, K, E)
        self.bq, self.bk, self.bv = bias(c.qkv_bias, H, E), bias(c.qkv_bias, K, E), bias(c.qkv_bias, K, E)
        self.q_norm, self.k_norm = ((init_param(rngs, (L, E), c, "ones"), init_param(rngs, (L, E), c, "ones"))
                                    if c.qk_norm else (None, None))
        self.wo, self.bo = weight(H, E, D), bias(c.out_bias, D)
        self.mlp_norm = init_param(rngs, (L, D), c, "ones")
        self.mlp_norm_bias = bias(layer_norm, D)
        gated = c.mlp == "gated_silu"
        self.w_gate, self.b_gate = (weight(D, F), bias(c.mlp_bias, F)) if gated else (None, None)
        self.w_up, self.b_up = weight(D, F), bias(c.mlp_bias, F)
        self.w_down, self.b_down = weight(F, D), bias(c.mlp_bias, D)


def _value(param, dtype):
    return None if param is None else param[...].astype(dtype)


def _project(x, w, b, spec: str, dtype, *, row_parallel: bool = False):
    """x @ w (+ b). row_parallel: the contraction is what specjax.sharding splits over devices (the
    attention-output and down projections), so the result comes out in float32 and is rounded once
    after the partial products are summed, as on one device."""
    w = _value(w, dtype)
    y = einsum_f32(spec, x, w).astype(dtype) if row_parallel else jnp.einsum(spec, x, w)
    return y if b is None else y + _value(b, dtype)


def _mlp(x: Float[Array, "B T D"], layer: StackedLayers | DecodingLayer, config: ModelConfig) -> Float[Array, "B T D"]:
    dtype = config.jnp_dtype
    if getattr(layer, "w_gate_up", None) is not None:  # DecodingLayer: one product, shard-major [M, 2, F / M]
        gate_up = _project(x, layer.w_gate_up, layer.b_gate_up, "btd,dmgf->btmgf", dtype)
        gate, up = (gate_up[:, :, :, i].reshape(*x.shape[:2], -1) for i in (0, 1))
        act = jax.nn.silu(gate) * up
    elif config.mlp == "gated_silu":
        up = _project(x, layer.w_up, layer.b_up, "btd,df->btf", dtype)
        gate = _project(x, layer.w_gate, layer.b_gate, "btd,df->btf", dtype)
        act = jax.nn.silu(gate) * up
    else:
        act = jax.nn.gelu(_project(x, layer.w_up, layer.b_up, "btd,df->btf", dtype), approximate=True)
    return _project(act, layer.w_down, layer.b_down, "btf,fd->btd", dtype, row_parallel=True)


def _on_one_device() -> bool:
    """No mesh of several devices is set (GSPMD cannot split a Pallas kernel's call)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1


def query_slots_for(batch: int, num_new: int, cache: KVCache | None) -> Int[Array, "B T"]:
    """Cache slots of T new tokens: after each row's fill level, or 0..T-1 with no cache."""
    offsets = jnp.zeros(batch, jnp.int32) if cache is None else cache.lengths
    return offsets[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]


def project_qkv(h: Float[Array, "B T D"], layer: StackedLayers | DecodingLayer, positions: Int[Array, "B T"],
                config: ModelConfig) -> tuple[Float[Array, "B T H E"], Float[Array, "B T K E"], Float[Array, "B T K E"]]:
    """One layer's queries, keys and values of its (normalised) input h: projected, per-head normed
    (Qwen3) and rotated to `positions`, as the attention and the KV cache take them."""
    c, dtype = config, config.jnp_dtype
    if getattr(layer, "wqkv", None) is not None:  # DecodingLayer: one product, shard-major [M, H/M + 2K/M, E]
        qkv = _project(h, layer.wqkv, layer.bqkv, "btd,dmne->btmne", dtype)
        q_heads, kv_heads = c.num_heads // qkv.shape[2], c.num_kv_heads // qkv.shape[2]  # per shard
        q, k, v = (qkv[:, :, :, start:stop].reshape(*h.shape[:2], -1, c.head_dim) for start, stop in
                   ((0, q_heads), (q_heads, q_heads + kv_heads), (q_heads + kv_heads, q_heads + 2 * kv_heads)))
    else:
        q = _project(h, layer.wq, layer.bq, "btd,dhe->bthe", dtype)
        k = _project(h, layer.wk, layer.bk, "btd,dke->btke", dtype)
        v = _project(h, layer.wv, layer.bv, "btd,dke->btke", dtype)
    if layer.q_norm is not None:  # Qwen3
        q, k = normalize(q, layer.q_norm[...], None, c), normalize(k, layer.k_norm[...], None, c)
    if c.position == "rope":
        inv_freq = rope_inverse_frequencies(c)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    return q, k, v


def decoder_layer(x: Float[Array, "B T D"], layer: StackedLayers | DecodingLayer, index, positions: Int[Array, "B T"],
                  query_slots: Int[Array, "B T"], cache: KVCache | None, config: ModelConfig, *,
                  attn_input: Float[Array, "B T D2"] | None = None, causal: bool = True,
                  visible: Bool[Array, "B T S"] | NewTokenMask | None = None) -> tuple[Float[Array, "B T D"], KVCache | None]:
    """One pre-norm decoder layer (`layer` holds one layer's weights, `index` its cache layer).

    attn_input, when given, replaces the normalised residual stream as what q, k and v are projected
    from (EAGLE heads feed their own inputs there); x stays the residual stream. causal and visible:
    which slots a new token sees (see `attention`).
    """
    c, dtype = config, config.jnp_dtype
    h = attn_input if attn_input is not None else normalize(
        x, layer.attn_norm[...], _value(layer.attn_norm_bias, dtype), c)
    q, k, v = project_qkv(h, layer, positions, c)
    attn, cache = _attend(q, k, v, layer, index, query_slots, cache, c, causal=causal, visible=visible)
    return _layer_output(x, attn, layer, c), cache


def _attend(q, k, v, layer, index, query_slots: Int[Array, "B T"], cache: KVCache | None, config: ModelConfig, *,
            causal: bool = True, visible=None) -> tuple[Float[Array, "B T H E"], KVCache | None]:
    """decoder_layer's attention of new queries, keys and values: written into the cache (where there is one)
    and attended, through the Pallas kernel where it fits."""
    c, dtype = config, config.jnp_dtype
    # A cache in another dtype (kv_cache_dtype) stays with XLA, which fuses its conversion into the
    # attention; the kernel would read a converted copy of the whole cache.
    # A tree's mask goes to the kernel as it is (without a sliding window, which XLA's masks leave out too).
    tree = isinstance(visible, NewTokenMask) and c.sliding_window is None
    if (cache is not None and (visible is None or tree) and getattr(layer, "attention_kernel", False)
            and cache.dtype == q.dtype and decode_attention.fits(q.shape[1], c.num_query_groups, tree)
            and _on_one_device()):
        attn, k_layer, v_layer = decode_attention.decode_attention(
            q, k, v, *cache.layer(index), query_slots, sliding_window=c.sliding_window, causal=causal,
            sees=visible.sees if tree else None)
        return attn, cache.with_layer(index, k_layer, v_layer)
    if cache is None and visible is None and causal and c.attention_impl != "einsum":
        return full_causal_attention(q, k, v, c), cache
    if cache is not None:
        cache = cache.write(index, k, v)
        k, v = cache.layer(index)
    if isinstance(visible, NewTokenMask):
        visible = visible.dense(query_slots[:, 0], k.shape[1])
    return attention(q, k.astype(dtype), v.astype(dtype), query_slots, c, causal=causal, visible=visible), cache


def _layer_output(x: Float[Array, "B T D"], attn: Float[Array, "B T H E"], layer, config: ModelConfig):
    """The residual stream after a layer's attention output and MLP."""
    dtype = config.jnp_dtype
    x = x + _project(attn, layer.wo, layer.bo, "bthe,hed->btd", dtype, row_parallel=True)
    h = normalize(x, layer.mlp_norm[...], _value(layer.mlp_norm_bias, dtype), config)
    return x + _mlp(h, layer, config)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("tokens", "rows", "starts"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class PromptChunks:
    """Prompt chunks a decode step also prefills (mixed prefill): chunk r holds the C prompt tokens of cache row
    rows[r] from position starts[r]. A row past the batch is no chunk (its writes are dropped). Two chunks of one
    row may run together: every chunk's keys are written before any chunk attends."""

    tokens: Int[Array, "R C"]
    rows: Int[Array, " R"]
    starts: Int[Array, " R"]

    @property
    def positions(self) -> Int[Array, "R C"]:
        return self.starts[:, None] + jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :]


def mixed_layer(x: Float[Array, "B T D"], xc: Float[Array, "R C D"], layer, index, positions: Int[Array, "B T"],
                query_slots: Int[Array, "B T"], chunks: PromptChunks, cache: KVCache, config: ModelConfig, *,
                visible: NewTokenMask | None = None) -> tuple[Float[Array, "B T D"], Float[Array, "R C D"], KVCache]:
    """decoder_layer over a step's new tokens x and prompt chunks xc at once: one token axis through every
    projection and the MLP (the weights are read once for both: a memory-bound decode step prefills for about
    the compute), attention apart (the rows' as decoder_layer's, `visible` a draft tree's). A row being prefilled
    is a done row whose fill level is its prompt's length (decoding.admit_prompts): the step's garbage write for it
    lands past its prompt, never on a chunk's slot."""
    c, dtype = config, config.jnp_dtype
    (batch, num_new), (num_chunks, width) = x.shape[:2], xc.shape[:2]
    packed = jnp.concatenate([x.reshape(1, batch * num_new, -1), xc.reshape(1, num_chunks * width, -1)], axis=1)
    h = normalize(packed, layer.attn_norm[...], _value(layer.attn_norm_bias, dtype), c)
    every = jnp.concatenate([positions.reshape(1, -1), chunks.positions.reshape(1, -1)], axis=1)
    split = lambda a: (a[0, :batch * num_new].reshape(batch, num_new, *a.shape[2:]),  # noqa: E731
                       a[0, batch * num_new:].reshape(num_chunks, width, *a.shape[2:]))
    (q, q_chunks), (k, k_chunks), (v, v_chunks) = map(split, project_qkv(h, layer, every, c))
    # Every write before any read, so that XLA updates the cache in place (a read between two writes makes it copy).
    cache = cache.write_rows(index, chunks.rows, chunks.starts, k_chunks, v_chunks)
    attn, cache = _attend(q, k, v, layer, index, query_slots, cache, c, visible=visible)
    rows = jnp.minimum(chunks.rows, batch - 1)  # a no-chunk lane reads a row it does not use
    k_rows, v_rows = (a[rows].astype(dtype) for a in cache.layer(index))
    attn_chunks = attention(q_chunks, k_rows, v_rows, chunks.positions, c)  # a prompt's cache slot is its position
    attn = jnp.concatenate([attn.reshape(1, batch * num_new, *attn.shape[2:]),
                            attn_chunks.reshape(1, num_chunks * width, *attn.shape[2:])], axis=1)
    return (*split(_layer_output(packed, attn, layer, c)), cache)


def scan_layers(step, carry, layers: StackedLayers | nnx.List, num_layers: int):
    """Runs `step(carry, layer, index) -> (carry, out)` over every layer: one lax.scan over stacked
    layers (index traced), a Python loop over the decoding layout's (index an int). Returns the carry
    and the outs, which index by layer either way (stacked by the scan, a list from the loop)."""
    if isinstance(layers, StackedLayers):
        return jax.lax.scan(lambda carry, scanned: step(carry, *scanned), carry, (layers, jnp.arange(num_layers)))
    outs = []
    for index, layer in enumerate(layers):
        carry, out = step(carry, layer, index)
        outs.append(out)
    return carry, outs


class Transformer(nnx.Module):
    """A decoder-only LM. See the module docstring for the call contract."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        c = config
        self.embed = init_param(rngs, (c.vocab_size, c.hidden_size), c)
        self.pos_embed = (init_param(rngs, (c.max_position_embeddings, c.hidden_size), c)
                          if c.position == "learned" else None)
        self.layers: StackedLayers | nnx.List = StackedLayers(c, rngs=rngs)  # nnx.List: see to_decoding_layout
        self.final_norm = init_param(rngs, (c.hidden_size,), c, "ones")
        self.final_norm_bias = init_param(rngs, (c.hidden_size,), c, "zeros") if c.norm == "layer" else None
        self.lm_head = None if c.tie_word_embeddings else init_param(rngs, (c.hidden_size, c.vocab_size), c)

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        cache: KVCache | None = None,
        *,
        hidden_layers: tuple[int, ...] = (),
        compute_logits: bool = True,
        causal: bool = True,
        attention_mask: Bool[Array, "B T S"] | NewTokenMask | None = None,
    ) -> tuple[Float[Array, "B T V"] | None, Hidden, KVCache | None]:
        """Runs T new tokens per row.

        With a cache, row b's tokens go to slots lengths[b] .. lengths[b] + T - 1 and attend to every
        earlier slot; the returned cache has lengths + T (callers lower it for padding or rejected
        drafts). Without one, the T tokens attend causally among themselves (a full forward).
        causal=False: the new tokens see one another (a DFlash draft block); attention_mask: which
        slots (of the cache after the write, or of the T tokens without one) each new token sees,
        in place of both rules, or a NewTokenMask (a draft tree's). Logits are float32; with
        compute_logits=False they are None (see `unembed`). Products run at config's matmul precision.
        """
        with precision_scope(self.config):
            return self.forward(tokens, positions, cache, hidden_layers=hidden_layers, compute_logits=compute_logits,
                                causal=causal, attention_mask=attention_mask)

    def forward(self, tokens, positions, cache, *, hidden_layers, compute_logits, causal, attention_mask):
        """__call__ without its precision scope."""
        return self._forward(tokens, positions, cache, None, hidden_layers=hidden_layers, compute_logits=compute_logits,
                             causal=causal, attention_mask=attention_mask)[:3]

    def mixed(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"], cache: KVCache, chunks: PromptChunks, *,
              hidden_layers: tuple[int, ...] = (), attention_mask: NewTokenMask | None = None,
              compute_logits: bool = True) -> tuple[Float[Array, "B T V"] | None, Hidden, KVCache, Hidden]:
        """A step's T new tokens per row (as __call__ with a cache) and prompt chunks prefilled in the same
        forward (mixed_layer): the rows' logits and hidden states, the cache with both written, and the chunks'
        hidden states (final and hidden_layers; unembedded where the caller needs a prompt's next token). lengths
        + T as __call__'s; the chunks' rows' fill levels are the caller's."""
        with precision_scope(self.config):
            return self._forward(tokens, positions, cache, chunks, hidden_layers=hidden_layers,
                                 compute_logits=compute_logits, causal=True, attention_mask=attention_mask)

    def _forward(self, tokens, positions, cache, chunks, *, hidden_layers, compute_logits, causal, attention_mask):
        c = self.config
        for index in hidden_layers:
            if not 0 <= index <= c.num_layers:
                raise ValueError(f"hidden_layers entry {index} is out of range: allowed 0..{c.num_layers}")
        x = self._embed(tokens, positions)
        xc = None if chunks is None else self._embed(chunks.tokens, chunks.positions)
        num_new = tokens.shape[1]
        query_slots = query_slots_for(tokens.shape[0], num_new, cache)
        if isinstance(attention_mask, NewTokenMask) and isinstance(self.layers, StackedLayers):
            # Stacked layers attend through XLA: the dense mask once, not in every step of the scan.
            attention_mask = attention_mask.dense(query_slots[:, 0], num_new if cache is None else cache.max_length)

        def layer_step(carry, layer, index):
            x, xc, cache = carry
            if xc is None:
                out, cache = decoder_layer(x, layer, index, positions, query_slots, cache, c, causal=causal,
                                           visible=attention_mask)
                return (out, None, cache), ((x, None) if hidden_layers else None)
            out, out_chunks, cache = mixed_layer(x, xc, layer, index, positions, query_slots, chunks, cache, c,
                                                 visible=attention_mask)
            return (out, out_chunks, cache), ((x, xc) if hidden_layers else None)

        step = checkpointed(layer_step, c) if cache is None else layer_step  # only a full forward is differentiated
        (x, xc, cache), layer_inputs = scan_layers(step, (x, xc, cache), self.layers, c.num_layers)
        if hidden_layers and isinstance(layer_inputs, list):  # the decoding layout's loop: one (x, xc) a layer
            layer_inputs = tuple(list(part) for part in zip(*layer_inputs))

        def hidden(final, which: int) -> Hidden:  # layer_inputs[i] is the input of layer i; L the last one's output
            layers = None
            if hidden_layers:
                layers = jnp.stack([layer_inputs[which][i] if i < c.num_layers else final for i in hidden_layers])
            return Hidden(final=normalize(final, self.final_norm[...], _value(self.final_norm_bias, c.jnp_dtype), c),
                          layers=layers)

        rows = hidden(x, 0)
        if cache is not None:
            cache = cache.with_lengths(cache.lengths + num_new)
        logits = self.unembed(rows.final) if compute_logits else None
        return logits, rows, cache, None if xc is None else hidden(xc, 1)

    def _embed(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        x = self.embed[...][tokens]
        if self.pos_embed is not None:
            x = x + self.pos_embed[...][positions]
        return x.astype(self.config.jnp_dtype)

    def create_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """An empty KV cache for this model: one array per layer in the decoding layout, stacked otherwise."""
        return KVCache.create(self.config, batch_size, max_length, dtype,
                              per_layer=not isinstance(self.layers, StackedLayers))

    def unembed(self, final_hidden: Float[Array, "... D"]) -> Float[Array, "... V"]:
        """Float32 logits from final hidden states (the tied embedding or the LM head)."""
        return unembed(final_hidden, self.embed[...], _value(self.lm_head, self.config.jnp_dtype),
                       self.config.jnp_dtype, self.config.matmul_precision)


def unembed(final_hidden: Float[Array, "... D"], embed: Float[Array, "V D"], lm_head: Float[Array, "D V"] | None,
            dtype, precision: str = "auto") -> Float[Array, "... V"]:
    """Float32 logits through lm_head, or through the embedding when it is tied (lm_head None), at matmul
    precision `precision` (ModelConfig.matmul_precision's values; 'auto' by dtype)."""
    x = final_hidden.astype(dtype)
    with jax.default_matmul_precision(matmul_precision_for(jnp.dtype(dtype).name, precision)):
        if lm_head is None:
            return einsum_f32("...d,vd->...v", x, embed.astype(dtype))
        return einsum_f32("...d,dv->...v", x, lm_head.astype(dtype))


class DecodingLayer(nnx.Module):
    """One layer's weights in the decoding layout (see to_decoding_layout): no layer axis, and q, k, v in one
    weight and the MLP's gate and up in another, so a decode step makes four matrix products a layer
    instead of seven (each small product leaves part of the memory bandwidth unused).

    The fused weights are shard-major for `model_shards` devices on the model axis: wqkv is
    [D, M, H/M + 2 K/M, E] and w_gate_up [D, M, 2, F/M], so that splitting their M axis (specjax.sharding)
    gives each device its own heads and MLP columns, as the separate weights' rules do. model_shards
    must divide the query heads, KV heads and MLP width, else the layout is made for one device.

    attention_kernel: decode steps and verification blocks write the cache and attend through the
    Pallas kernel pallas_kernels.decode_attention, which reads only the filled cache, instead of XLA's
    cache writes and six kernels over all of it. By default on GPUs for a layout made for one device,
    where the kernel compiles (decode_attention.available(): else XLA, with one warning); on a mesh of
    several devices (GSPMD cannot split a kernel's call) and with a cache of another dtype than the
    model's, the attention stays in XLA."""

    def __init__(self, layers: StackedLayers, index: int, config: ModelConfig, model_shards: int = 1,
                 attention_kernel: bool | None = None):
        c = config
        divides = all(n % model_shards == 0 for n in (c.num_heads, c.num_kv_heads, c.intermediate_size))
        M = model_shards if divides else 1
        if attention_kernel is None:
            attention_kernel = jax.default_backend() == "gpu" and M == 1 and decode_attention.available()
        self.attention_kernel = attention_kernel
        take = lambda w: None if w is None else w[...][index]  # noqa: E731
        # attn_norm is None in EAGLE-1's head layer.
        self.attn_norm, self.attn_norm_bias = _optional(take(layers.attn_norm)), _optional(take(layers.attn_norm_bias))
        self.mlp_norm, self.mlp_norm_bias = nnx.Param(take(layers.mlp_norm)), _optional(take(layers.mlp_norm_bias))
        self.wo, self.bo = nnx.Param(take(layers.wo)), _optional(take(layers.bo))
        self.q_norm, self.k_norm = _optional(take(layers.q_norm)), _optional(take(layers.k_norm))
        self.w_down, self.b_down = nnx.Param(take(layers.w_down)), _optional(take(layers.b_down))

        def by_shard(*parts, lead: int):  # [lead..., N_i, ...] each -> [lead..., M, sum N_i / M, ...]
            split = [p.reshape(*p.shape[:lead], M, p.shape[lead] // M, *p.shape[lead + 1:]) for p in parts]
            return jnp.concatenate(split, axis=lead + 1)

        q_k_v = [take(w) for w in (layers.wq, layers.wk, layers.wv)]
        self.wqkv = nnx.Param(by_shard(*q_k_v, lead=1))
        biases = [take(b) for b in (layers.bq, layers.bk, layers.bv)]
        self.bqkv = _optional(None if biases[0] is None else by_shard(*biases, lead=0))
        if c.mlp == "gated_silu":
            gate, up = take(layers.w_gate), take(layers.w_up)
            self.w_gate_up = nnx.Param(jnp.stack([gate.reshape(gate.shape[0], M, -1),
                                                  up.reshape(up.shape[0], M, -1)], axis=2))
            b_gate, b_up = take(layers.b_gate), take(layers.b_up)
            self.b_gate_up = _optional(None if b_gate is None else jnp.stack(
                [b_gate.reshape(M, -1), b_up.reshape(M, -1)], axis=1))
            self.w_up = self.b_up = None
        else:
            self.w_gate_up = self.b_gate_up = None
            self.w_up, self.b_up = nnx.Param(take(layers.w_up)), _optional(take(layers.b_up))


def _optional(value) -> nnx.Param | None:
    return None if value is None else nnx.Param(value)


def to_decoding_layout(model: Transformer, model_shards: int = 1, attention_kernel: bool | None = None) -> Transformer:
    """The same model in the decoding layout: one DecodingLayer per layer, run as a Python loop (see
    the module docstring and DecodingLayer). model_shards: the size of the mesh's model axis it will
    be split over (specjax.sharding); attention_kernel: see DecodingLayer. The weights are new buffers
    (keep the stacked model only if it is needed again); a model already split is returned as is."""
    if not isinstance(model.layers, StackedLayers):
        return model
    c = model.config
    split = jax.tree.map(lambda w: w, model)  # a new module over the same arrays
    split.layers = nnx.List([DecodingLayer(model.layers, i, c, model_shards, attention_kernel)
                             for i in range(c.num_layers)])
    return split


# Per-layer weight bytes from which the decoding layout pays on a GPU in compile time as well as in step
# time; below, its faster steps do not win back its slower compile in a short run (docs/performance.md).
DECODING_LAYOUT_MIN_LAYER_BYTES = 32 << 20


def layer_weight_bytes(module) -> int:
    """Bytes of one decoder layer's weights (the mean over the module's stacked layers; 0 with none)."""
    stacks = [node for _, node in nnx.iter_graph(module) if isinstance(node, StackedLayers)]
    leaves = [leaf for stack in stacks for leaf in jax.tree.leaves(nnx.state(stack, nnx.Param))]
    layers = sum(stack.wo.shape[0] for stack in stacks)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves) // max(layers, 1)


def for_decoding(module, model_shards: int = 1, convert=to_decoding_layout):
    """convert(module, model_shards) where the decoding layout pays, else the module as is.

    The rule: on GPUs, layers of 32 MiB of weights or more (DECODING_LAYOUT_MIN_LAYER_BYTES; docs/performance.md).
    Smaller models (the bundled ones) and other backends keep the stacked layout: it compiles faster,
    and on TPUs, where scans over stacked weights are the usual practice, the layout is unmeasured.
    convert: to_decoding_layout for a Transformer, eagle.head_to_decoding_layout for an EAGLE head."""
    pays = jax.default_backend() == "gpu" and layer_weight_bytes(module) >= DECODING_LAYOUT_MIN_LAYER_BYTES
    return convert(module, model_shards) if pays else module


def num_parameters(module: nnx.Module) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def init_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """A randomly initialised model (normal(0, init_std) weights, unit norms, zero biases)."""
    return Transformer(config, rngs=nnx.Rngs(params=seed))

"""Block verification in one sweep over the vocabulary (Pallas).

The jnp reference (specjax/verify/block.py) reads the target and draft distributions twice: once
for the residual masses Z_i, once more at the accepted length tau for the residual sample. tau
depends on every Z_i, so the sample cannot wait for it in a single pass; instead the kernel draws
the residual sample of *every* candidate position in the same sweep that sums the masses (the
exponential race is a running max), and the epilogue picks the candidate at tau.

Grid: (row block, vocabulary tile j). Each program reads P[rows, :, tile j] (K + 1 positions),
Q[rows, :, tile j] (K positions) and E[rows, tile j], and writes per row and position i its partial mass
sum max(p_i P_i - Q_i, 0), its best race score max w / E and that score's vocabulary index. The
prefix ratios p_0..p_K only need p(X_i) and q(X_i), 2K gathered numbers per row, so they are
computed before the sweep. Bytes: (2K + 2) V floats per row in, O(K V / tile) out.

Only probabilistic drafts need the sweep: with one-hot drafts Z has a closed form and the residual
is needed at tau alone, which the jnp reference already reads in one gather.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from specjax.verify import block  # the jnp reference (specjax.verify.block), not the registry
from specjax.verify.common import Draws, from_draws, gather_position

# The tile width and warp count that read fastest where measured (scripts/bench_verify.py; docs/performance.md).
DEFAULT_TILE = 1024
TRITON_NUM_WARPS = 8
_NO_INDEX = jnp.iinfo(jnp.int32).max
# Which Pallas GPU lowering compiles the kernel (see gpu_compiler_params): Triton, the one
# scripts/bench_verify.py checks against the reference.
GPU_LOWERING = "triton"


def gpu_compiler_params(lowering: str | None = None, backend: str | None = None):
    """Compiler parameters that select a Pallas GPU lowering ('mosaic_gpu' or 'triton'); None off GPU.
    backend defaults to JAX's default backend."""
    if (backend or jax.default_backend()) != "gpu":
        return None
    lowering = lowering or GPU_LOWERING
    if lowering == "mosaic_gpu":
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return plgpu.CompilerParams()
    if lowering == "triton":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=TRITON_NUM_WARPS)
    raise ValueError(f"GPU lowering {lowering!r} is unknown: allowed 'mosaic_gpu', 'triton'")


def _sweep_kernel(ratios_ref, p_ref, q_ref, e_ref, mass_ref, score_ref, index_ref, *, vocab_size, tile):
    """One (row block, vocabulary tile) program; see the module docstring."""
    rows, num_draft = q_ref.shape[0], q_ref.shape[1]
    start = pl.program_id(1) * tile
    vocab_index = start + jax.lax.broadcasted_iota(jnp.int32, (rows, tile), 1)
    valid = vocab_index < vocab_size  # the last tile runs past the vocabulary
    exponentials = e_ref[:, 0, :]
    for i in range(num_draft + 1):
        target = jnp.where(valid, p_ref[:, i, :], 0.0)
        if i < num_draft:
            draft = jnp.where(valid, q_ref[:, i, :], 0.0)
            weights = jnp.maximum(ratios_ref[:, i][:, None] * target - draft, 0.0)
            mass_ref[:, 0, 0, i] = jnp.sum(weights, axis=1)
        else:
            weights = target
        # The race of specjax.verify.common.race_sample: zero weights never win.
        scores = jnp.where(weights > 0, weights / exponentials, -1.0)
        best = jnp.max(scores, axis=1)
        score_ref[:, 0, 0, i] = best
        index_ref[:, 0, 0, i] = jnp.min(jnp.where(scores == best[:, None], vocab_index, _NO_INDEX), axis=1)


def sweep(target_probs: Float[Array, "B K1 V"], draft_probs: Float[Array, "B K V"],
          exponentials: Float[Array, "B V"], ratios: Float[Array, "B K1"], *, tile: int = DEFAULT_TILE,
          rows_per_block: int | None = None, interpret: bool | None = None, compiler_params=None):
    """Per-tile partial residual masses [B, J, K], race scores and indices [B, J, K + 1].

    rows_per_block: rows each program takes; by default 1 compiled on GPU (the fastest there), 8 on
    TPU (its sublane count), and 64 in interpret mode, whose cost grows with the number of programs
    faster than linearly."""
    batch, num_positions, vocab = target_probs.shape
    num_draft = num_positions - 1
    tile = min(tile, pl.next_power_of_2(vocab))
    num_tiles = pl.cdiv(vocab, tile)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if compiler_params is None and not interpret:
        compiler_params = gpu_compiler_params()
    if rows_per_block is None:
        rows_per_block = min(batch, 64 if interpret else {"gpu": 1, "tpu": 8}.get(jax.default_backend(), 8))
    partial_shape = (batch, num_tiles, 1, num_positions)  # the singleton keeps TPU's (8, 128) rule
    kernel = functools.partial(_sweep_kernel, vocab_size=vocab, tile=tile)
    masses, scores, indices = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(batch, rows_per_block), num_tiles),
        in_specs=[
            pl.BlockSpec((rows_per_block, num_positions), lambda b, j: (b, 0)),
            pl.BlockSpec((rows_per_block, num_positions, tile), lambda b, j: (b, 0, j)),
            pl.BlockSpec((rows_per_block, num_draft, tile), lambda b, j: (b, 0, j)),
            pl.BlockSpec((rows_per_block, 1, tile), lambda b, j: (b, 0, j)),
        ],
        out_specs=[pl.BlockSpec((rows_per_block, 1, 1, num_positions), lambda b, j: (b, j, 0, 0))] * 3,
        out_shape=[jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.int32)],
        interpret=interpret,
        compiler_params=compiler_params,
        name="block_verify_sweep",
    )(ratios, target_probs, draft_probs, exponentials[:, None, :])
    return masses[:, :, 0, :num_draft], scores[:, :, 0], indices[:, :, 0]


def verify_with_draws(target_probs: Float[Array, "B K1 V"], draft_tokens: Int[Array, "B K"],
                      draft_probs: Float[Array, "B K V"] | None, draws: Draws, *, tile: int = DEFAULT_TILE,
                      interpret: bool | None = None, compiler_params=None, num_valid=None):
    """Block verification with the same outputs as specjax.verify.block.verify_with_draws. A block cut short
    (num_valid) takes the jnp reference: the kernel's sweep draws a residual at every position but the last,
    where a cut block draws its bonus."""
    if draft_probs is None or num_valid is not None:
        return block.verify_with_draws(target_probs, draft_tokens, draft_probs, draws, num_valid=num_valid)
    ratios = block.prefix_ratios(target_probs, draft_tokens, draft_probs)
    masses, scores, indices = sweep(target_probs, draft_probs, draws.exponentials, ratios, tile=tile,
                                    interpret=interpret, compiler_params=compiler_params)
    tau = block.accepted_length(block.stopping_from_masses(masses.sum(axis=1), ratios), draws.uniforms)
    # The candidate at tau: the first tile holding the best score (argmax picks the first), and the
    # first index within it, which is the reference's first index overall.
    scores_at_tau = jnp.take_along_axis(scores, tau[:, None, None], axis=2)[:, :, 0]  # [B, J]
    best_tile = jnp.argmax(scores_at_tau, axis=1)
    next_token = gather_position(jnp.take_along_axis(indices, tau[:, None, None], axis=2)[:, :, 0], best_tile)
    # A row whose candidate weights are all zero (rounding only) takes token 0, as the reference does.
    next_token = jnp.where(gather_position(scores_at_tau, best_tile) > 0, next_token, 0)
    return tau, next_token


verify = from_draws(verify_with_draws)


def small_instance(backend: str):
    """The kernel on `backend` (compiled, not interpreted) and abstract arguments of a small instance:
    what kernel_available compiles. Powers of two, which every lowering takes as blocks."""
    batch, num_draft, vocab = 1, 1, 128
    draws = Draws(uniforms=jax.ShapeDtypeStruct((batch, num_draft), jnp.float32),
                  exponentials=jax.ShapeDtypeStruct((batch, vocab), jnp.float32))
    args = (jax.ShapeDtypeStruct((batch, num_draft + 1, vocab), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_draft), jnp.int32),
            jax.ShapeDtypeStruct((batch, num_draft, vocab), jnp.float32), draws)
    kernel = functools.partial(verify_with_draws, interpret=False, compiler_params=gpu_compiler_params(backend=backend))
    return kernel, args


@functools.cache
def kernel_available(backend: str) -> bool:
    """Whether the kernel compiles on backend, found once per process by compiling a small instance.
    The CPU interprets it; elsewhere it needs a Pallas lowering (Triton on GPUs, which JAX deprecates).
    Where that lowering is missing or fails, warns once and returns False: the caller then runs the jnp
    block verifier, which gives the same tokens."""
    if backend == "cpu":
        return True
    try:
        kernel, args = small_instance(backend)
        jax.jit(kernel).lower(*args).compile()
    except Exception as error:  # ImportError without the lowering; lowerings raise their own types
        warnings.warn(f"verify_impl 'pallas': the Pallas block verifier does not compile on {backend} "
                      f"({type(error).__name__}: {error}); running the jnp block verifier instead, which gives "
                      "the same tokens", RuntimeWarning, stacklevel=2)
        return False
    return True

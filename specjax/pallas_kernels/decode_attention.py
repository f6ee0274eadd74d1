"""A few new tokens' cache write and attention against the KV cache, reading only its filled part (Pallas).

A decode step (T = 1) or a verification block (T = K + 1) writes its keys and values to the cache and
attends to every cache slot up to its own. XLA runs that as two cache writes and six attention kernels
a layer over all S_max slots; here it is one kernel over the filled slots (and a small combine when the
slots are split). The new keys and values enter as inputs: a program merges the ones falling in its
blocks into what it reads from the cache and writes them there, so no program needs another's writes.
What that saves, and where it costs (large batches), is in docs/performance.md.

Flash-decoding: the grid is (row b, KV head, row tile, slot split j). A program takes the G query heads
of its KV head for the T new tokens as a [T * G, E] block of rows (padded to the 16 rows a tensor-core
product needs; a draft tree's block, up to MAX_TREE_TOKENS tokens, in tiles of MAX_ROWS rows, each
program with every new token's key and value) and walks its split's blocks of cache slots with an
online softmax. A tree's mask (`sees`) enters as each row's [T] row and picks the visible new slots by a
one-hot product, as the new keys are picked. With one split
it writes the normalised output; with several, each writes its partial output, running max and
running sum, and a combine weighs the splits by exp(max - overall max). Splits buy parallelism at
the cost of that second pass: the default takes enough of them for TARGET_PROGRAMS programs and for
no program to walk more than MAX_BLOCKS blocks (the measured choice: docs/performance.md). Split
boundaries are fixed by the shapes alone (never by the fill level), so T = 1 and T = K + 1 sum the
same blocks in the same order: a row's result agrees to rounding however many tokens attend with it
(tested), though not always bit for bit, since a decode step's and a verification block's row blocks
are products of different shapes. XLA's weight products of 1 and K + 1 rows differ in the same way, so
greedy speculative decoding equals greedy autoregressive decoding up to near-ties.

Lowered through Pallas' Triton backend, which JAX deprecates (Mosaic GPU, its recommended GPU backend,
would need a warpgroup-level rewrite for products this small). `available()` says whether that
lowering is there and compiles the kernel; where it does not, the models attend through XLA
(transformer.DecodingLayer), with one warning. Off the GPU the kernel runs in Pallas' interpret mode,
which is what the CPU tests check against KVCache.write and transformer.attention; they also lower it
for CUDA to catch what Triton cannot lower.
"""

from __future__ import annotations

import functools
import importlib
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

BLOCK_SLOTS = 64  # cache slots per step of a program's loop
MIN_ROWS = 16  # rows of a tensor-core product
MAX_ROWS = 64  # query rows a program takes; T * G above this (a prefill) is left to XLA, except a tree's
MAX_TREE_TOKENS = 128  # a draft tree's block: its T * G rows split into MAX_ROWS-row tiles
TARGET_PROGRAMS = 128  # about one per multiprocessor of an H100 / H200 (132)
MAX_BLOCKS = 8  # blocks one program walks at most
NUM_WARPS = 4
_MASKED = -1e30  # finite, so that exp(_MASKED - _MASKED) of a fully masked split is no NaN


TRITON = "jax.experimental.pallas.triton"  # the lowering's module (its masked store runs in interpret mode too)


def fits(num_new: int, num_query_groups: int, tree: bool = False) -> bool:
    """Whether T new tokens with G query heads per KV head fit the kernel: T * G rows in one program's row
    block, or for a draft tree's block (`sees` given) T <= MAX_TREE_TOKENS over several row tiles."""
    return num_new <= MAX_TREE_TOKENS if tree else num_new * num_query_groups <= MAX_ROWS


def _kernel(q_ref, new_k_ref, new_v_ref, slots_ref, token_slots_ref, *refs, block: int, blocks_per_split: int,
            num_slots: int, num_new: int, sliding_window: int | None, causal: bool, tree: bool, scale: float):
    """One (row, KV head, row tile, split) program: online softmax over the split's visible cache blocks
    for one tile of query rows, with the new tokens' keys and values taken from new_k_ref / new_v_ref and
    written to the cache (by every tile's program alike: the same values). refs: the tree's sees rows
    (with tree), the caches, out_ref, the running max and sum refs when there are several splits (out_ref
    is then partial), then the cache outputs (the caches' own buffers)."""
    sees_ref, refs = (refs[0], refs[1:]) if tree else (None, refs)
    k_ref, v_ref, out_ref, *split_refs, k_out_ref, v_out_ref = refs
    store = importlib.import_module(TRITON).store  # a masked store
    q = q_ref[...]  # [M, E]
    new_k, new_v = new_k_ref[...], new_v_ref[...]  # [N, E]: row t is new token t, rows >= T zero
    slots = slots_ref[...]  # [M]; padding rows hold -1 and see nothing
    token_slots = token_slots_ref[...]  # [N]: new token t's slot, -1 past T
    first_new = jnp.min(jnp.where(token_slots >= 0, token_slots, num_slots))  # the row's fill level
    last_new = jnp.max(token_slots)
    # Non-causal (a DFlash draft block): every new token sees up to the row's last new slot. A tree's
    # query sees no slot past its own (its ancestors come before it).
    limits = slots if causal or tree else jnp.where(slots >= 0, last_new, -1)
    first = pl.program_id(3) * blocks_per_split
    # Blocks past the last query slot hold no visible key: the loop stops at the filled part.
    stop = jnp.minimum(first + blocks_per_split, jnp.max(limits) // block + 1)
    start = first
    if sliding_window is not None:
        start = jnp.maximum(first, jnp.maximum(first_new - sliding_window + 1, 0) // block)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    contract_last = (((1,), (1,)), ((), ()))
    contract_rows = (((1,), (0,)), ((), ()))
    rows, head_dim = q.shape
    new_rows = new_k.shape[0]

    def step(index, carry):
        out, running_max, running_sum = carry
        nominal = index * block
        # The last block is moved back to end at the last slot rather than read past it; the slots
        # it shares with the block before are masked, having been counted there.
        offset = jnp.minimum(nominal, num_slots - block)
        k, v = k_ref[pl.ds(offset, block), :], v_ref[pl.ds(offset, block), :]

        def merge_new(k, v):
            """The new tokens' slots hold stale entries until written: their keys and values come from
            the inputs, picked by a one-hot product (exact: one nonzero term per sum), and are written
            there. They equal what the cache will hold bit for bit, so the attention reads the same
            keys and values whether a token is new in this call or was written by an earlier one."""
            slot_column = offset + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
            token = slot_column - first_new  # [block, 1]
            is_new = (token >= 0) & (token < num_new) & (slot_column >= nominal)
            pick = (token == jax.lax.broadcasted_iota(jnp.int32, (1, new_rows), 1)).astype(q.dtype)  # [block, N]

            def merge(cached, new, out_ref):
                picked = jax.lax.dot_general(pick, new, contract_rows, precision=precision,
                                             preferred_element_type=jnp.float32).astype(cached.dtype)
                merged = jnp.where(is_new, picked, cached)
                store(out_ref.at[pl.ds(offset, block), :], merged, mask=jnp.broadcast_to(is_new, merged.shape))
                return merged

            return merge(k, new_k, k_out_ref), merge(v, new_v, v_out_ref)

        # Only the block or two at the end of the filled part hold new slots.
        holds_new = (offset + block > first_new) & (offset < first_new + num_new)
        k, v = jax.lax.cond(holds_new, merge_new, lambda k, v: (k, v), k, v)
        scores = jax.lax.dot_general(q, k, contract_last, precision=precision,
                                     preferred_element_type=jnp.float32) * scale  # [M, block]
        keys = offset + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        visible = (keys >= nominal) & (keys <= limits[:, None])
        if tree:  # a new key is visible where the query's sees row holds its token: a one-hot product
            key_token = keys - first_new  # [1, block]
            picks = (jax.lax.broadcasted_iota(jnp.int32, (new_rows, 1), 0) == key_token).astype(q.dtype)  # [N, block]
            seen = jax.lax.dot_general(sees_ref[...], picks, contract_rows, preferred_element_type=jnp.float32)
            visible &= (key_token < 0) | (seen > 0)
        if sliding_window is not None:
            visible &= keys > slots[:, None] - sliding_window
        scores = jnp.where(visible, scores, _MASKED)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1))
        probs = jnp.where(visible, jnp.exp(scores - new_max[:, None]), 0.0)
        correction = jnp.exp(running_max - new_max)
        out = correction[:, None] * out + jax.lax.dot_general(
            probs.astype(v.dtype), v, contract_rows, precision=precision, preferred_element_type=jnp.float32)
        return out, new_max, correction * running_sum + jnp.sum(probs, axis=1)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _MASKED, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    out, running_max, running_sum = jax.lax.fori_loop(start, stop, step, init)
    if split_refs:
        out_ref[...] = out
        split_refs[0][...] = running_max
        split_refs[1][...] = running_sum
    else:  # padding rows saw nothing: 0 / 1
        out_ref[...] = (out / jnp.where(running_sum > 0, running_sum, 1.0)[:, None]).astype(out_ref.dtype)


def decode_attention(q: Float[Array, "B T H E"], k_new: Float[Array, "B T K E"], v_new: Float[Array, "B T K E"],
                     k_cache: Float[Array, "B S K E"], v_cache: Float[Array, "B S K E"],
                     query_slots: Int[Array, "B T"], *, sliding_window: int | None = None, causal: bool = True,
                     sees: Bool[Array, "B T T"] | None = None, num_splits: int | None = None,
                     block: int = BLOCK_SLOTS, interpret: bool | None = None,
                     ) -> tuple[Float[Array, "B T H E"], Float[Array, "B S K E"], Float[Array, "B S K E"]]:
    """KVCache.write then transformer.attention, for T * G <= MAX_ROWS new tokens, in one kernel.

    query_slots: the new tokens' slots, consecutive from each row's fill level (query_slots_for).
    Returns the attention output (the query at slot t sees slots <= t, and > t - sliding_window; with
    causal=False every slot up to the row's last new one, as transformer.attention; with `sees`, a draft
    tree's mask (transformer.NewTokenMask), every committed slot and new token j where sees[b, t, j],
    for up to MAX_TREE_TOKENS new tokens) and the caches with the new keys and values written at
    query_slots; the caches' buffers are updated in place where XLA can (they are donated, or dead after
    the call), else copied first. num_splits: slot splits per (row, KV head); by default enough for
    TARGET_PROGRAMS programs and at most MAX_BLOCKS blocks a program."""
    batch, num_new, num_heads, head_dim = q.shape
    num_slots, num_kv = k_cache.shape[1], k_cache.shape[2]
    groups = num_heads // num_kv
    rows = num_new * groups
    tree = sees is not None
    if not fits(num_new, groups, tree):
        raise ValueError(f"decode_attention takes T * G <= {MAX_ROWS} query rows per KV head (T <= "
                         f"{MAX_TREE_TOKENS} with a tree's sees), got T = {num_new}, G = {groups}: use "
                         "transformer.attention")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"decode_attention needs the caches in the queries' dtype {q.dtype}, got k_cache "
                         f"{k_cache.dtype} and v_cache {v_cache.dtype}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    block = min(block, 1 << (num_slots.bit_length() - 1))  # a power of two <= S
    num_blocks = pl.cdiv(num_slots, block)
    if num_splits is None:
        num_splits = max(pl.cdiv(TARGET_PROGRAMS, batch * num_kv), pl.cdiv(num_blocks, MAX_BLOCKS))
    blocks_per_split = pl.cdiv(num_blocks, max(1, min(num_splits, num_blocks)))
    num_splits = pl.cdiv(num_blocks, blocks_per_split)
    tile = min(MAX_ROWS, max(MIN_ROWS, pl.next_power_of_2(rows)))  # query rows a program takes
    num_tiles = pl.cdiv(rows, tile)
    new_rows = max(MIN_ROWS, pl.next_power_of_2(num_new))  # the new tokens' keys and values, every tile's
    padded = max(num_tiles * tile, new_rows)

    # One array of row blocks [3, B, K, M, E] (one XLA fusion with the projections' epilogue): for KV
    # head h, [0] has query head h * G + g of token t at row t * G + g; [1] and [2] its new keys and
    # values, token t at row t.
    def to_rows(x, heads):
        x = x.reshape(batch, num_new, num_kv, heads, head_dim).transpose(0, 2, 1, 3, 4)
        x = x.reshape(batch, num_kv, num_new * heads, head_dim).astype(q.dtype)
        return jnp.pad(x, ((0, 0), (0, 0), (0, padded - num_new * heads), (0, 0)))

    stacked = jnp.stack([to_rows(q, groups), to_rows(k_new, 1), to_rows(v_new, 1)])
    query_slots = query_slots.astype(jnp.int32)
    row_slots = jnp.pad(jnp.repeat(query_slots, groups, axis=1), ((0, 0), (0, padded - rows)), constant_values=-1)
    token_slots = jnp.pad(query_slots, ((0, 0), (0, new_rows - num_new)), constant_values=-1)
    tree_inputs, tree_specs = [], []
    if tree:  # query row t * G + g's sees row: token t's, as the queries' dtype for the kernel's products
        rows_sees = jnp.repeat(sees, groups, axis=1).astype(q.dtype)
        tree_inputs = [jnp.pad(rows_sees, ((0, 0), (0, padded - rows), (0, new_rows - num_new)))]
        tree_specs = [pl.BlockSpec((None, tile, new_rows), lambda b, h, i, j: (b, i, 0))]

    compiler_params = None if interpret else importlib.import_module(TRITON).CompilerParams(
        num_warps=NUM_WARPS, num_stages=2)
    kernel = functools.partial(_kernel, block=block, blocks_per_split=blocks_per_split, num_slots=num_slots,
                               num_new=num_new, sliding_window=sliding_window, causal=causal, tree=tree,
                               scale=1.0 / math.sqrt(head_dim))
    row_block = pl.BlockSpec((None, None, None, tile), lambda b, h, i, j: (b, h, j, i))
    out_block = pl.BlockSpec((None, None, None, tile, head_dim), lambda b, h, i, j: (b, h, j, i, 0))
    cache_block = pl.BlockSpec((None, num_slots, None, head_dim), lambda b, h, i, j: (b, 0, h, 0))
    partial_shape = (batch, num_kv, num_splits, num_tiles * tile)
    split = num_splits > 1
    out_specs = [out_block, row_block, row_block] if split else [out_block]
    out_shape = [jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32 if split else q.dtype),
                 *[jax.ShapeDtypeStruct(partial_shape, jnp.float32)] * (2 if split else 0)]
    cache_index = 5 + len(tree_inputs)  # the caches' positions among the inputs
    *results, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(batch, num_kv, num_tiles, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, None, tile, head_dim), lambda b, h, i, j: (0, b, h, i, 0)),
            *[pl.BlockSpec((None, None, None, new_rows, head_dim), lambda b, h, i, j, n=n: (n, b, h, 0, 0))
              for n in (1, 2)],
            pl.BlockSpec((None, tile), lambda b, h, i, j: (b, i)),
            pl.BlockSpec((None, new_rows), lambda b, h, i, j: (b, 0)),
            *tree_specs,
            cache_block,
            cache_block,
        ],
        out_specs=[*out_specs, cache_block, cache_block],
        out_shape=[*out_shape, jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={cache_index: len(out_shape), cache_index + 1: len(out_shape) + 1},
        interpret=interpret,
        compiler_params=compiler_params,
        name="decode_attention",
    )(stacked, stacked, stacked, row_slots, token_slots, *tree_inputs, k_cache, v_cache)
    if split:  # combine the splits: each weighs exp(its max - the overall max)
        out, split_max, split_sum = results
        weights = jnp.exp(split_max - split_max.max(axis=2, keepdims=True))  # [B, K, J, M]
        total = jnp.sum(weights * split_sum, axis=2)  # [B, K, M]
        out = jnp.sum(weights[..., None] * out, axis=2)  # [B, K, M, E]; a reduction, not a product
        out = out / jnp.where(total > 0, total, 1.0)[..., None]  # padding rows: 0 / 1
    else:
        out = results[0][:, :, 0]
    out = out[:, :, :rows].reshape(batch, num_kv, num_new, groups, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, num_new, num_heads, head_dim).astype(q.dtype), k_cache, v_cache


@functools.cache
def available() -> bool:
    """Whether the kernel runs on this backend: Pallas' Triton lowering imports, and a small instance
    compiles and runs (compiled on a GPU, interpreted elsewhere). Checked once a process, when a layout
    that would use the kernel is built (transformer.DecodingLayer), so no step pays for it; False
    comes with one warning, and the models then attend through XLA."""
    try:
        importlib.import_module(TRITON)
        q = jnp.zeros((1, 1, 2, 64), jnp.float32)
        new, cache = jnp.zeros((1, 1, 1, 64), jnp.float32), jnp.zeros((1, BLOCK_SLOTS, 1, 64), jnp.float32)
        jax.block_until_ready(jax.jit(decode_attention)(q, new, new, cache, cache, jnp.zeros((1, 1), jnp.int32)))
    except Exception as error:  # noqa: BLE001 (an import, lowering or compile error: each means no kernel)
        warnings.warn(f"the Pallas decode-attention kernel is not available here ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); the models attend through XLA "
                      "instead (transformer.attention), which is slower on GPUs", RuntimeWarning, stacklevel=2)
        return False
    return True

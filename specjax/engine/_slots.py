"""Rows of a loop state written into an engine's slots.

A loop state (decoding.DecodeState or SpecState, with the proposer's own state inside) has the batch on
some axis of every leaf, not always the first (a stacked KV cache: [layers, B, ...]). Which axis is found
once per program by tracing the state's initialiser at two batch sizes (jax.eval_shape: no compute)
and seeing which axis follows the batch."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np

from specjax.decoding import NO_BATCH, put_rows


def batch_axes(init_at: Callable[[int], object]) -> tuple[int, ...]:
    """The batch axis of each leaf of init_at(batch)'s state (flattened order), NO_BATCH where none."""
    one, two = (jax.tree.leaves(jax.eval_shape(functools.partial(init_at, size))) for size in (1, 2))

    def axis(a, b):
        moved = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(moved) > 1:
            raise ValueError(f"a state leaf of shapes {a.shape} / {b.shape} at batch 1 / 2 has several batch axes")
        return moved[0] if moved else NO_BATCH

    return tuple(axis(a, b) for a, b in zip(one, two))


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnums=0)
def insert_rows(state, rows, slots: jax.Array, *, axes: tuple[int, ...]):
    """state with rows' batch entries written at slots (an index past the engine's batch drops that row:
    the padding of an admission bucket). The engine's state is donated: written in place."""
    return put_rows(state, rows, slots, axes)


def padded_slots(slots: list[int], fill: int) -> np.ndarray:
    """slots padded with fill to a power-of-two count: the slot functions compile once per bucket of counts,
    not once per count (fill past the state's rows: a target or slot that is dropped)."""
    out = np.full(1 << max(0, len(slots) - 1).bit_length(), fill, np.int32)
    out[:len(slots)] = slots
    return out


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnums=0)
def move_rows(state, sources: jax.Array, targets: jax.Array, *, axes: tuple[int, ...]):
    """state with the rows at sources copied to targets (every leaf with a batch axis; a target past the
    state's rows is dropped: padded_slots' padding); the engine's state is donated. The rows left at sources
    are stale: the caller marks them done."""
    leaves, treedef = jax.tree.flatten(state)

    def move(x, axis):
        if axis == NO_BATCH:
            return x
        index = (slice(None),) * axis
        return x.at[index + (targets,)].set(x[index + (sources,)], mode="drop")

    return jax.tree.unflatten(treedef, [move(x, a) for x, a in zip(leaves, axes)])


@functools.partial(jax.jit, donate_argnums=0)
def release_slots(done: jax.Array, slots: jax.Array) -> jax.Array:
    """The done flags with slots marked done (finished by the host: a stop id, a cancelled request)."""
    return done.at[slots].set(True, mode="drop")


"""Draft KV offload (EngineConfig.draft_kv_offload): the drafter's KV cache kept in pinned host memory.

Every KVCache in the proposer state (the draft model's, an EAGLE head's, DFlash's context KV, MTP's) has its
keys and values taken out of the engine's device state and kept on the host, one flat buffer per slot (all
of a row's draft K and V, packed). A visit's run program brings in the buffers of the slots it steps, unpacks
them into the cache leaves, runs its steps, and sends them back packed (engine/_programs.py, run_steps).
Admission packs the prefilled rows and sends them to their slots' buffers; compaction, which moves a busy
row into a free slot, moves a buffer reference on the host, no data.

Why per slot, not one host array with the batch on an axis: the moves are then whole-array transfers between
memory kinds (jax.device_put inside the jitted programs), the case JAX documents and tests on GPUs; slicing or
scattering rows of an array that lives in host memory inside a program depends on what XLA's host offloader
accepts, which differs by backend. And a visit moves only the rows it steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from specjax.decoding import NO_BATCH
from specjax.models.kv_cache import KVCache

HOST = "pinned_host"  # page-locked host memory: the device copies it by DMA, without a staging copy


def check_host_memory(device) -> None:
    """Raises ValueError naming the field where the device has no pinned host memory kind to offload to."""
    kinds = [memory.kind for memory in device.addressable_memories()]
    if HOST not in kinds:
        raise ValueError(f"EngineConfig.draft_kv_offload = True is invalid on {device.platform} device {device}: "
                         f"its memory kinds are {kinds}; allowed only where {HOST!r} is one of them")


@dataclasses.dataclass(frozen=True)
class DraftKVLayout:
    """Where the drafter's keys and values sit in the engine's flattened state, and how a row of them packs
    into one flat buffer (static: built once per program from the state's shapes)."""

    offloaded: tuple[bool, ...]  # per state leaf: one of the drafter's K or V arrays
    axes: tuple[int, ...]  # the state leaves' batch axes (batch_axes), NO_BATCH where the engine keeps its copy
    shapes: tuple[tuple[int, ...], ...]  # per offloaded leaf, its shape without the batch axis
    dtype: Any
    device: Any

    @classmethod
    def of(cls, state_shapes, proposer_state_shapes, axes: tuple[int, ...], device, method: str) -> DraftKVLayout:
        """The layout of a state (jax.eval_shape's output; proposer_state_shapes is its proposer state)."""
        caches = [leaf for leaf in jax.tree.leaves(proposer_state_shapes, is_leaf=lambda x: isinstance(x, KVCache))
                  if isinstance(leaf, KVCache)]
        # The same objects as the state's leaves: eval_shape's output, walked twice.
        kv = {id(x) for cache in caches for x in jax.tree.leaves((cache.k, cache.v))}
        leaves = jax.tree.leaves(state_shapes)
        offloaded = tuple(id(x) in kv for x in leaves)
        if not any(offloaded):
            raise ValueError(f"EngineConfig.draft_kv_offload = True is invalid for method {method!r}: its drafter keeps "
                             "no KV cache; allowed for drafters that keep one (draft_model, eagle, eagle3, dflash, "
                             "dspark, mtp)")
        parts = [(x, a) for x, a, off in zip(leaves, axes, offloaded) if off]
        dtypes = {x.dtype for x, _ in parts}
        if len(dtypes) > 1 or any(a == NO_BATCH for _, a in parts):
            raise ValueError(f"the drafter's KV cache of method {method!r} mixes dtypes {sorted(map(str, dtypes))} or "
                             "has a leaf without a batch axis: draft_kv_offload packs one dtype, per row")
        return cls(offloaded=offloaded, axes=axes, shapes=tuple(x.shape[:a] + x.shape[a + 1:] for x, a in parts),
                   dtype=parts[0][0].dtype, device=device)

    @property
    def resident_axes(self) -> tuple[int, ...]:
        """The batch axes the slot functions (insert_rows, move_rows) use on the engine's state: NO_BATCH for the
        offloaded leaves, whose place in the state holds an empty placeholder."""
        return tuple(NO_BATCH if off else a for a, off in zip(self.axes, self.offloaded))

    @property
    def row_size(self) -> int:
        """Elements of one row's packed buffer."""
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def bytes_per_slot(self) -> int:
        return self.row_size * np.dtype(self.dtype).itemsize

    def strip(self, state):
        """state with each offloaded leaf replaced by an empty array (its data lives in DraftKVSlots), committed
        to the device: the run program's outputs are (its host buffers are committed arrays), and a program is
        compiled again for arguments whose commitment changed, so the state starts as it will stay."""
        leaves, treedef = jax.tree.flatten(state)
        stripped = jax.tree.unflatten(treedef, [jnp.zeros((0,), self.dtype) if off else x
                                                for x, off in zip(leaves, self.offloaded)])
        return jax.device_put(stripped, SingleDeviceSharding(self.device))

    def pack(self, leaves: list) -> jax.Array:
        """[B, row_size]: each row's offloaded leaves, flattened and joined (traced)."""
        parts = [x for x, off in zip(leaves, self.offloaded) if off]
        axes = [a for a, off in zip(self.axes, self.offloaded) if off]
        return jnp.concatenate([jnp.moveaxis(x, a, 0).reshape(x.shape[a], -1) for x, a in zip(parts, axes)], axis=1)

    def unpack(self, packed: jax.Array, leaves: list) -> list:
        """leaves with the offloaded ones rebuilt from packed [B, row_size] (traced)."""
        sizes = [math.prod(shape) for shape in self.shapes]
        pieces = iter(jnp.split(packed, np.cumsum(sizes)[:-1].tolist(), axis=1))
        shapes, axes = iter(self.shapes), iter(a for a, off in zip(self.axes, self.offloaded) if off)
        out = []
        for x, off in zip(leaves, self.offloaded):
            if not off:
                out.append(x)
                continue
            shape, axis = next(shapes), next(axes)
            out.append(jnp.moveaxis(next(pieces).reshape((packed.shape[0],) + shape), 0, axis))
        return out

    def to_device(self, buffers: tuple) -> jax.Array:
        """[len(buffers), row_size] on the device from the slots' host buffers (traced)."""
        device = SingleDeviceSharding(self.device, memory_kind="device")
        return jnp.stack([jax.device_put(buffer, device) for buffer in buffers])

    def to_host(self, packed: jax.Array) -> tuple:
        """One host buffer per row of packed (traced)."""
        host = SingleDeviceSharding(self.device, memory_kind=HOST)
        return tuple(jax.device_put(packed[row], host) for row in range(packed.shape[0]))


@functools.partial(jax.jit, static_argnames="layout")
def pack_to_host(leaves: list, *, layout: DraftKVLayout) -> tuple:
    """Rows' offloaded leaves packed into one host buffer per row (one program per layout and admission bucket,
    shared by engines of equal settings)."""
    return layout.to_host(layout.pack(leaves))


class DraftKVSlots:
    """The host buffers of the engine's slots, and what has moved between device and host."""

    def __init__(self, layout: DraftKVLayout, num_slots: int):
        self.layout = layout
        self.buffers: list[jax.Array | None] = [None] * num_slots
        self.bytes_in = 0  # host to device, all visits together
        self.bytes_out = 0  # device to host (visits and admissions)

    def store(self, rows, slots: list[int]) -> None:
        """Packs the drafter's KV of a prefilled rows state and sends row i to slot slots[i]'s buffer (an index
        past the slots drops that row: an admission bucket's padding)."""
        buffers = pack_to_host(jax.tree.leaves(rows), layout=self.layout)
        for buffer, slot in zip(buffers, slots):
            if slot < len(self.buffers):
                self.buffers[slot] = buffer
                self.bytes_out += self.layout.bytes_per_slot

    def move(self, sources: list[int], targets: list[int]) -> None:
        """Compaction: each source slot's buffer becomes its target's (a reference on the host, no copy)."""
        for source, target in zip(sources, targets):
            self.buffers[target] = self.buffers[source]

    def take(self, rows: int) -> tuple:
        """The buffers of the first `rows` slots, for a run; counted as moved in and, after it, out."""
        self.bytes_in += rows * self.layout.bytes_per_slot
        self.bytes_out += rows * self.layout.bytes_per_slot
        return tuple(self.buffers[:rows])

    def put(self, buffers: tuple) -> None:
        """A run's buffers back into the first slots."""
        self.buffers[:len(buffers)] = buffers

    def stats(self) -> dict:
        return {"bytes_per_slot": self.layout.bytes_per_slot, "slots": len(self.buffers),
                "host_bytes": self.layout.bytes_per_slot * sum(b is not None for b in self.buffers),
                "bytes_to_device": self.bytes_in, "bytes_to_host": self.bytes_out}

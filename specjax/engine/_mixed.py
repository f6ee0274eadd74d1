"""Mixed prefill (EngineConfig.mixed_prefill_tokens): which prompt chunks a visit's steps prefill.

An admitted request waits in its slot (decoding.admit_prompts: a done row holding its prompt) while the visit's first
steps prefill its prompt in chunks, in the same forward as the running rows' tokens (decoding.decode_step with a
ChunkPlan). The host plans the chunks before each visit: the waiting prompts' next chunks in the order they arrived,
`chunks` a step; the visit runs the steps that prefill as a loop of their own before the others, and the host learns
from the visit's step count which chunks ran (a visit may end early, when a row ends and requests wait).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import decoding


@functools.partial(jax.tree_util.register_dataclass, data_fields=("rows", "starts", "count"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class ChunkSchedule:
    """A visit's prompt chunks: step i < count prefills chunks rows[i, r] from starts[i, r]."""

    rows: jax.Array  # [steps_per_visit, mixed_prefill_chunks]: slots (past the state's rows: no chunk)
    starts: jax.Array  # [steps_per_visit, mixed_prefill_chunks]
    count: jax.Array  # steps that prefill

    def at(self, step, width: int, proposer_axes=None, cache_axes=None) -> decoding.ChunkPlan:
        """The chunks of step `step` (traced), `width` tokens each (the axes: decoding.ChunkPlan's)."""
        step = jnp.minimum(step, self.rows.shape[0] - 1)
        return decoding.ChunkPlan(rows=self.rows[step], starts=self.starts[step], width=width,
                                  proposer_axes=proposer_axes, cache_axes=cache_axes)


def plan_chunks(waiting: list[tuple[int, Any]], *, steps: int, chunks: int, width: int, nowhere: int,
                one_per_step: bool = False) -> tuple[ChunkSchedule, list[tuple[int, Any, int, int]]]:
    """The schedule of the next chunks of the waiting prompts (slot, request in the engine's books: its `prefilled`
    prompt tokens and `request.prompt`), in the order given, `chunks` a step for up to `steps` steps (a slot past the
    state's rows, `nowhere`, pads it); one_per_step: one chunk of a prompt a step at most (speculation: each chunk
    extends the drafter's state as the step began). Returns the schedule and (the slot, the request, the step, its
    prompt tokens in the cache after the chunk) for each chunk, which the engine applies once the visit's step count
    is known."""
    rows, starts = np.full((steps, chunks), nowhere, np.int32), np.zeros((steps, chunks), np.int32)
    todo = [(slot, running, list(range(running.prefilled, len(running.request.prompt), width)))
            for slot, running in waiting]
    planned = []
    for step in range(steps):
        lane = 0
        for slot, running, left in todo:
            while left and lane < chunks:
                rows[step, lane], starts[step, lane] = slot, left.pop(0)
                planned.append((slot, running, step, int(starts[step, lane]) + width))
                lane += 1
                if one_per_step:
                    break
        if not lane:
            break
    used = {step for _, _, step, _ in planned}
    return ChunkSchedule(rows=rows, starts=starts, count=np.int32(len(used))), planned

"""Acceptance statistics, counted per row inside the loop and summarised on the host.

Counted as vLLM and EAGLE count them: a step drafts K tokens and accepts n of them (0..K); the mean
acceptance length tau is 1 + accepted / steps (the +1 is the correction or bonus token every step
emits). `emitted` is what the row actually kept: it falls short of accepted + steps only at the
step where the row hit its budget or an EOS inside the block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from specjax import sharding


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("steps", "drafted", "accepted", "emitted", "length_histogram", "accepted_at",
                                "per_step_accepted"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class AcceptanceCounters:
    steps: Int[Array, " B"]
    drafted: Int[Array, " B"]
    accepted: Int[Array, " B"]
    emitted: Int[Array, " B"]  # tokens kept from speculative steps
    length_histogram: Int[Array, "B K1"]  # steps that accepted exactly n drafts, n = 0..K
    accepted_at: Int[Array, "B K"]  # steps whose i-th draft was accepted
    # Drafts accepted at each of the row's steps (vLLM's detailed per-request metrics); steps past the
    # array's width (the cache's slots, which bound a row's steps) are not recorded.
    per_step_accepted: Int[Array, "B S"]

    @classmethod
    def zeros(cls, batch: int, num_draft: int, max_steps: int = 0) -> AcceptanceCounters:
        zeros = jnp.zeros((batch,), jnp.int32)
        return cls(steps=zeros, drafted=zeros, accepted=zeros, emitted=zeros,
                   length_histogram=jnp.zeros((batch, num_draft + 1), jnp.int32),
                   accepted_at=jnp.zeros((batch, num_draft), jnp.int32),
                   per_step_accepted=jnp.zeros((batch, max_steps), jnp.int16))

    def update(self, active: Bool[Array, " B"], num_accepted: Int[Array, " B"],
               num_emitted: Int[Array, " B"]) -> AcceptanceCounters:
        num_draft = self.accepted_at.shape[1]
        step = active.astype(jnp.int32)
        return AcceptanceCounters(
            steps=self.steps + step,
            drafted=self.drafted + step * num_draft,
            accepted=self.accepted + step * num_accepted,
            emitted=self.emitted + step * num_emitted,
            length_histogram=self.length_histogram + step[:, None] * jax.nn.one_hot(
                num_accepted, num_draft + 1, dtype=jnp.int32),
            accepted_at=self.accepted_at + step[:, None] * (
                jnp.arange(num_draft)[None, :] < num_accepted[:, None]).astype(jnp.int32),
            per_step_accepted=self.per_step_accepted.at[
                jnp.arange(active.shape[0]), jnp.where(active, self.steps, self.per_step_accepted.shape[1])].set(
                num_accepted.astype(jnp.int16), mode="drop"),
        )


@dataclasses.dataclass(frozen=True)
class AcceptanceMetrics:
    """Host-side acceptance statistics of real rows (numpy arrays, one entry per row)."""

    steps: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    emitted: np.ndarray
    length_histogram: np.ndarray  # [B, K + 1]
    accepted_at: np.ndarray  # [B, K]
    per_step_accepted: np.ndarray  # [B, S]: row b's first steps[b] entries are its steps' accepted drafts

    @classmethod
    def from_counters(cls, counters: AcceptanceCounters, num_rows: int) -> AcceptanceMetrics:
        host = sharding.to_host(counters)
        return cls(**{f.name: np.asarray(getattr(host, f.name))[:num_rows].astype(np.int64)
                      for f in dataclasses.fields(AcceptanceCounters)})

    @property
    def num_speculative_tokens(self) -> int:
        return self.accepted_at.shape[1]

    def summary(self) -> dict:
        """Totals over all rows."""
        steps, accepted, drafted = int(self.steps.sum()), int(self.accepted.sum()), int(self.drafted.sum())
        return {
            "steps": steps,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else float("nan"),
            "mean_acceptance_length": 1 + accepted / steps if steps else float("nan"),
            "length_histogram": self.length_histogram.sum(0).tolist(),
            "per_position_acceptance": (self.accepted_at.sum(0) / steps).tolist() if steps else [],
        }

    def per_request(self) -> list[dict]:
        return [{
            "steps": int(self.steps[b]),
            "drafted": int(self.drafted[b]),
            "accepted": int(self.accepted[b]),
            "mean_acceptance_length": 1 + self.accepted[b] / self.steps[b] if self.steps[b] else float("nan"),
            "length_histogram": self.length_histogram[b].tolist(),
        } for b in range(len(self.steps))]

    def per_step(self, row: int) -> dict:
        """vLLM's detailed per-request arrays for one row: drafts accepted and drafted at each step."""
        steps = min(int(self.steps[row]), self.per_step_accepted.shape[1])
        return {"per_step_accepted": [int(n) for n in self.per_step_accepted[row, :steps]],
                "per_step_drafted": [self.num_speculative_tokens] * steps}

    def format_summary(self) -> str:
        s = self.summary()
        positions = " ".join(f"{rate:.2f}" for rate in s["per_position_acceptance"])
        return (f"speculative: K={self.num_speculative_tokens} steps={s['steps']} "
                f"accepted={s['accepted']}/{s['drafted']} ({s['acceptance_rate']:.1%}) "
                f"mean acceptance length={s['mean_acceptance_length']:.3f}\n"
                f"  accepted per position: {positions}\n"
                f"  acceptance-length histogram (0..K): {s['length_histogram']}")

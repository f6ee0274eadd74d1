"""Acceptance statistics, counted per row inside the loop and summarised on the host.

Counted as vLLM and EAGLE count them: a step drafts K tokens and accepts n of them (0..K); the mean
acceptance length tau is 1 + accepted / steps (the +1 is the correction or bonus token every step
emits). Like vLLM's scheduler stats, accepted counts drafts the verifier accepted past a row's budget or
EOS too. `emitted` is what the row actually kept: it falls short of accepted + steps only at the
step where the row hit its budget or an EOS inside the block (summaries report both).
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
                                "per_step_accepted", "per_step_drafted"),
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
    # Drafts verified at each of the row's steps: K, or the width adaptive verification chose (specjax.adaptive).
    per_step_drafted: Int[Array, "B S"]

    @classmethod
    def zeros(cls, batch: int, num_draft: int, max_steps: int = 0) -> AcceptanceCounters:
        zeros = jnp.zeros((batch,), jnp.int32)
        return cls(steps=zeros, drafted=zeros, accepted=zeros, emitted=zeros,
                   length_histogram=jnp.zeros((batch, num_draft + 1), jnp.int32),
                   accepted_at=jnp.zeros((batch, num_draft), jnp.int32),
                   per_step_accepted=jnp.zeros((batch, max_steps), jnp.int16),
                   per_step_drafted=jnp.zeros((batch, max_steps), jnp.int16))

    def update(self, active: Bool[Array, " B"], num_accepted: Int[Array, " B"], num_emitted: Int[Array, " B"],
               num_verified: Int[Array, " B"] | None = None) -> AcceptanceCounters:
        """Counts a step of the active rows; num_verified: the drafts each verified (default all K)."""
        num_draft = self.accepted_at.shape[1]
        step = active.astype(jnp.int32)
        if num_verified is None:
            num_verified = jnp.full_like(num_accepted, num_draft)
        at_step = (jnp.arange(active.shape[0]), jnp.where(active, self.steps, self.per_step_accepted.shape[1]))
        return AcceptanceCounters(
            steps=self.steps + step,
            drafted=self.drafted + step * num_verified,
            accepted=self.accepted + step * num_accepted,
            emitted=self.emitted + step * num_emitted,
            length_histogram=self.length_histogram + step[:, None] * jax.nn.one_hot(
                num_accepted, num_draft + 1, dtype=jnp.int32),
            accepted_at=self.accepted_at + step[:, None] * (
                jnp.arange(num_draft)[None, :] < num_accepted[:, None]).astype(jnp.int32),
            per_step_accepted=self.per_step_accepted.at[at_step].set(num_accepted.astype(jnp.int16), mode="drop"),
            per_step_drafted=self.per_step_drafted.at[at_step].set(num_verified.astype(jnp.int16), mode="drop"),
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
    # [B, S]: row b's first steps[b] entries are its steps' accepted drafts (None: not recorded)
    per_step_accepted: np.ndarray | None = None
    per_step_drafted: np.ndarray | None = None  # [B, S]: drafts verified at each step (None: all K)

    @classmethod
    def from_counters(cls, counters: AcceptanceCounters, num_rows: int) -> AcceptanceMetrics:
        host = sharding.to_host(counters)
        return cls(**{f.name: np.asarray(getattr(host, f.name))[:num_rows].astype(np.int64)
                      for f in dataclasses.fields(AcceptanceCounters)})

    @property
    def num_speculative_tokens(self) -> int:
        return self.accepted_at.shape[1]

    def summary(self) -> dict:
        """Totals over all rows (stats_fields' keys)."""
        return stats_fields(self.num_speculative_tokens, self.steps.sum(), self.drafted.sum(), self.accepted.sum(),
                            self.emitted.sum(), self.length_histogram.sum(0), self.accepted_at.sum(0))

    def per_request(self) -> list[dict]:
        """The same fields as summary(), one dict per row."""
        return [stats_fields(self.num_speculative_tokens, self.steps[b], self.drafted[b], self.accepted[b],
                             self.emitted[b], self.length_histogram[b], self.accepted_at[b])
                for b in range(len(self.steps))]

    def per_step(self, row: int) -> dict:
        """vLLM's detailed per-request arrays for one row: drafts accepted and drafted at each step."""
        if self.per_step_accepted is None:
            raise ValueError("these metrics were made without per-step counts (AcceptanceCounters.per_step_accepted)")
        steps = min(int(self.steps[row]), self.per_step_accepted.shape[1])
        # tolist: Python ints in one call (an engine ends up to a batch of requests at a visit, each ~100 steps)
        drafted = ([self.num_speculative_tokens] * steps if self.per_step_drafted is None
                   else np.asarray(self.per_step_drafted[row, :steps]).tolist())
        return {"per_step_accepted": np.asarray(self.per_step_accepted[row, :steps]).tolist(),
                "per_step_drafted": drafted}

    def format_summary(self) -> str:
        s = self.summary()
        positions = " ".join(f"{rate:.2f}" for rate in s["per_position_acceptance"])
        kept = ("" if s["mean_emitted_length"] == s["mean_acceptance_length"] else
                f" (tokens kept a step: {s['mean_emitted_length']:.3f}; drafts accepted past a row's budget or EOS "
                "are counted above, as vLLM counts them)")
        return (f"speculative: K={self.num_speculative_tokens} steps={s['steps']} "
                f"accepted={s['accepted']}/{s['drafted']} ({s['acceptance_rate']:.1%}) "
                f"mean acceptance length={s['mean_acceptance_length']:.3f}{kept}\n"
                f"  accepted per position: {positions}\n"
                f"  acceptance-length histogram (0..K): {s['length_histogram']}")


def stats_fields(num_spec_tokens: int, steps, drafted, accepted, emitted, histogram, accepted_at) -> dict:
    """Acceptance statistics of one row or of a total, as plain Python numbers, under specjax's names and
    vLLM's per-request names. Accepted drafts are what the verifier accepted, including drafts past a row's
    budget or EOS that the row did not keep: vLLM's scheduler counts them so too (num_accepted =
    len(generated_token_ids) - 1, before the output is cut at max_tokens or a stop token). What the rows
    kept is num_emitted_tokens; mean_emitted_length = num_emitted_tokens / steps, lower on short runs."""
    steps, drafted, accepted, emitted = int(steps), int(drafted), int(accepted), int(emitted)
    rate = accepted / drafted if drafted else float("nan")
    mean_length = 1 + accepted / steps if steps else float("nan")
    histogram = np.asarray(histogram, np.int64).tolist()
    per_position = (np.asarray(accepted_at, np.int64) / steps).tolist() if steps else []
    return {
        "steps": steps, "drafted": drafted, "accepted": accepted, "acceptance_rate": rate,
        "mean_acceptance_length": mean_length, "length_histogram": histogram,
        "per_position_acceptance": per_position,
        "emitted": emitted, "mean_emitted_length": emitted / steps if steps else float("nan"),
        # vLLM's per-request names (the OpenAI server's).
        "num_spec_steps": steps, "num_draft_tokens": drafted, "num_accepted_draft_tokens": accepted,
        "draft_acceptance_rate": rate, "acceptance_histogram": histogram, "num_spec_tokens": num_spec_tokens,
        "num_emitted_tokens": emitted,
    }

"""vLLM's per-request speculative-decoding object (`metrics.speculative_decoding` of a response)."""

from __future__ import annotations


def spec_decode_metrics(metrics: dict, level: str) -> dict | None:
    """vLLM's `metrics.speculative_decoding` object from the engine's per-request counts (RequestOutput.metrics):
    None at level 'none'; 'detailed' adds the per-step arrays. The one place the server names these fields.

    With no speculative step (a request that ended at its first token), mean_acceptance_length is 1 (every
    token came without drafts) and draft_acceptance_rate 0, where the ratios would divide by zero."""
    if level == "none" or metrics is None:
        return None
    steps, drafted, accepted = int(metrics["steps"]), int(metrics["drafted"]), int(metrics["accepted"])
    histogram = [int(n) for n in metrics["length_histogram"]]
    out = {"mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
           "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
           "acceptance_histogram": histogram,
           "num_spec_steps": steps,
           "num_accepted_draft_tokens": accepted,
           "num_draft_tokens": drafted,
           "num_spec_tokens": len(histogram) - 1}
    if level == "detailed":
        out |= {"per_step_accepted": list(metrics["per_step_accepted"]),
                "per_step_drafted": list(metrics["per_step_drafted"])}
    return out

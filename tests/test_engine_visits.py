"""What the engine's host reads after each visit (a small summary of the visit, not the whole state): every
request's tokens reach its stream at the visit that emitted them, the stream is its output, cut at its own
stop ids, and its acceptance counts are the ones `generate` counts for its prompt alone."""

import math

import pytest
from support.engine import SPECS, drafter_for, random_requests, serve_arriving
from support.models import EOS, target_and_drafts

from specjax.decoding import generate
from specjax.engine import Engine, EngineConfig

STEPS_PER_VISIT = 2


def without_nan(metrics: dict) -> dict:
    """The metrics with NaN (a request that ran no speculative step) as None, so that == compares them."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in metrics.items()}


@pytest.mark.loop
def test_each_visit_streams_its_tokens_and_the_counts_are_those_of_generate():
    target, _ = target_and_drafts()
    spec = SPECS["eagle"]
    streamed = {}
    config = EngineConfig(max_num_seqs=4, max_model_len=64, spec=spec, eos_token_ids=(EOS,),
                          steps_per_visit=STEPS_PER_VISIT, max_prefill_batch=4)
    engine = Engine(target, config, drafter=drafter_for("eagle"),
                    on_tokens=lambda request_id, ids: streamed.setdefault(request_id, []).append(list(ids)))
    requests = random_requests(16, seed=1)
    outputs = serve_arriving(engine, requests)
    most = STEPS_PER_VISIT * (spec.num_speculative_tokens + 1)  # what one visit can emit for a request
    for request in requests:
        output, chunks = outputs[request.request_id], streamed[request.request_id]
        assert [t for chunk in chunks for t in chunk] == list(output.tokens), request.request_id
        assert chunks[0] == [output.tokens[0]]  # the prefill's token alone, before the visit's steps
        assert all(0 < len(chunk) <= most for chunk in chunks[1:])  # each visit streamed what it emitted
        assert len(output.token_times) == len(output.tokens)
    stopped = [r for r in requests if set(outputs[r.request_id].tokens) & set(r.stop_token_ids)]
    assert stopped and all(outputs[r.request_id].tokens[-1] in r.stop_token_ids for r in stopped)
    # Requests without a stop id of their own: the counts of generate's speculative loop for them.
    plain = [r for r in requests if not r.stop_token_ids]
    result = generate(target, [list(r.prompt) for r in plain], max_new_tokens=[r.max_tokens for r in plain],
                      eos_token_ids=(EOS,), spec=spec, drafter=drafter_for("eagle"))
    for row, request in enumerate(plain):
        want = result.metrics.per_request()[row] | result.metrics.per_step(row)
        assert without_nan(outputs[request.request_id].metrics) == without_nan(want), request.request_id

"""Mixed prefill (EngineConfig.mixed_prefill_tokens): prompts prefilled in chunks by the decode steps themselves, in
the same forward as the running rows' tokens. Each request's output is still what `generate` gives it alone: greedy
under load in both model layouts, with several chunks of one prompt in one step, with async scheduling; sampled
requests draw exactly generate's tokens (their keys are numbered by their own tokens, so the engine's draws are
generate's, not only distributed as them). With speculation the drafter's state is built by the chunks too: every
request's acceptance counts equal those of the engine that prefills in calls of its own (the same drafts), which a
drafter left unprefilled fails while its greedy output stays right (30 of 32 requests differ for the draft model)."""

import re

import numpy as np
import pytest
from support.engine import (SPECS, autoregressive_under_load, drafter_for, load_config, load_group, random_requests,
                            serve_arriving, served_under_load, truncated_at_stop)
from support.models import target_and_drafts

from specjax.config import SamplingConfig, SpecConfig
from specjax.decoding import generate
from specjax.engine import Engine, EngineConfig, Request
from specjax.models.transformer import to_decoding_layout


@pytest.mark.loop
@pytest.mark.parametrize("layout, tokens, chunks, options", [
    ("decoding", 4, 3, {}),  # a 14-token prompt's four chunks in two steps
    ("stacked", 16, 2, {"async_scheduling": True}),
])
def test_every_request_gets_its_autoregressive_output_with_prompts_prefilled_in_decode_steps(
        layout, tokens, chunks, options):
    """32 requests arriving at random steps, 4 slots, prompts of 2-14 tokens in chunks of `tokens`: greedy output
    equal to generate's autoregressive output for each prompt alone; no prefill call of its own."""
    target = target_and_drafts()[0]
    target = to_decoding_layout(target) if layout == "decoding" else target
    engine = Engine(target, load_config(None, mixed_prefill_tokens=tokens, mixed_prefill_chunks=chunks, **options))
    requests = random_requests(32)
    outputs = serve_arriving(engine, requests)
    for request, want in zip(requests, autoregressive_under_load()):
        assert list(outputs[request.request_id].tokens) == truncated_at_stop(want, request.stop_token_ids)
    stats = engine.stats()
    assert stats["prefill_calls"] == 0 and stats["prefilled_requests"] == 32
    assert stats["prefill_chunks"] == sum(-(-len(r.prompt) // tokens) for r in requests)
    assert set(engine.step_programs().values()) <= {0, 1}  # one program for each count of slots stepped


@pytest.mark.loop
def test_sampled_requests_draw_generates_tokens_beside_greedy_ones():
    """Greedy, T 0.7 top-p 0.9 and T 1 top-k 5 requests with prompts prefilled in decode steps: each request's tokens
    are those generate draws for its prompt and seed alone (which tests/test_sampling.py checks against the target's
    distribution); the sampled ones differ from greedy decoding, so the comparison sees the draws."""
    target = target_and_drafts()[0]
    settings = [SamplingConfig(), SamplingConfig(temperature=0.7, top_p=0.9), SamplingConfig(temperature=1.0, top_k=5)]
    rng = np.random.default_rng(3)
    requests = [Request(request_id=str(i), prompt=tuple(rng.integers(1, 100, int(rng.integers(2, 15))).tolist()),
                        max_tokens=10, sampling=settings[i % 3], seed=i) for i in range(12)]
    engine = Engine(target, load_config(None, eos_token_ids=(), mixed_prefill_tokens=4, mixed_prefill_chunks=2))
    outputs = serve_arriving(engine, requests)
    want = generate(target, [list(r.prompt) for r in requests], max_new_tokens=10,
                    sampling=[r.sampling for r in requests], seeds=[r.seed for r in requests]).sequences()
    greedy = generate(target, [list(r.prompt) for r in requests], max_new_tokens=10).sequences()
    for request, tokens in zip(requests, want):
        assert list(outputs[request.request_id].tokens) == tokens, request
    assert sum(want[i] != greedy[i] for i in range(12) if i % 3) >= 6
    assert set(engine.step_programs().values()) <= {0, 1}


@pytest.mark.loop
def test_prompts_prefilled_in_decode_steps_from_the_prefix_cache_give_the_same_outputs():
    """Requests sharing system prompts, with the prefix cache: each request's tokens the autoregressive ones; the
    cache hits (the chunks start after the matched blocks: fewer chunks than without it) and every block a running
    request holds is released at its end."""
    from test_prefix_cache import autoregressive, serve, shared_prefix_requests

    requests = shared_prefix_requests()
    want = autoregressive(requests)
    runs = [serve(None, requests, mixed_prefill_tokens=4, mixed_prefill_chunks=2, **config)
            for config in (dict(), dict(enable_prefix_caching=True))]
    for outputs, _ in runs:
        assert {k: list(o.tokens) for k, o in outputs.items()} == want
    (_, off), (outputs, on) = runs
    stats = on.stats()["prefix_cache"]
    assert stats["hit_tokens"] > 0 and stats["hit_tokens"] == sum(o.num_cached_tokens for o in outputs.values())
    assert stats["stored_blocks"] > 0
    assert on.stats()["prefill_chunks"] < off.stats()["prefill_chunks"]
    assert not on.prefix_cache.table.refs.any()  # every block released


@pytest.mark.loop
def test_an_idle_engine_streams_the_first_token_when_the_prefill_steps_end():
    """With nothing decoding, a visit ends with its prompt chunks, so the time to first token is the prefill's (a
    10-token prompt in chunks of 4: 3 steps), not that of a whole visit of steps_per_visit."""
    target = target_and_drafts()[0]
    streamed = {}
    engine = Engine(target, load_config(None, mixed_prefill_tokens=4, steps_per_visit=8),
                    on_tokens=streamed.update)
    prompt = list(range(1, 11))
    engine.add_request(Request.make("a", prompt, 8))
    engine.step()
    assert engine.steps_run == 3
    assert streamed == {"a": generate(target, [prompt], max_new_tokens=1).sequences()[0]}


@pytest.mark.loop
@pytest.mark.parametrize("layout", ["stacked", "decoding"])
def test_the_visit_updates_the_caches_in_place(layout):
    """No copy of a cache-sized buffer in the compiled visit: a mixed step writes the chunks and the rows' entries
    before any read (a read between the two writes made XLA copy each layer's cache every step), and the prefilling
    steps run as a loop of their own (a lax.cond between the two kinds of step copied the caches at its entry: 8
    copies in this program)."""
    target = target_and_drafts()[0]
    target = to_decoding_layout(target) if layout == "decoding" else target
    engine = Engine(target, load_config(None, mixed_prefill_tokens=4, max_model_len=128, max_num_seqs=8))
    hlo = engine.step_hlo()
    cache = re.compile(r"= f32\[(\d+,)?8,128,\d+,\d+\]\S* copy\(")  # [layers,] slots, cache length, KV heads, head
    assert sum(1 for line in hlo.splitlines() if cache.search(line)) == 0
    assert re.search(r"f32\[(\d+,)?8,128,\d+,\d+\]", hlo)  # the pattern matches the caches' shape


@pytest.mark.loop
@pytest.mark.parametrize("name", [load_group(name) for name in ("draft_model_tree", "dflash", "medusa")])
def test_every_request_gets_its_autoregressive_output_and_the_same_drafts_with_a_drafter(name):
    """A tree of a draft model, DFlash (the target's hidden layers), Medusa (no cache; tests/test_adaptive.py serves
    DFlash with adaptive verification and mixed prefill): 32 requests arriving at random,
    prompts in chunks of 4, two a step (of different prompts): greedy output equal to autoregressive decoding, and each
    request's steps, drafted and accepted drafts those of the engine that prefills in calls of its own."""
    engine = Engine(target_and_drafts()[0], load_config(SPECS[name], mixed_prefill_tokens=4, mixed_prefill_chunks=2),
                    drafter=drafter_for(name))
    requests = random_requests(32)
    outputs = serve_arriving(engine, requests)
    _, reference = served_under_load(name)
    counts = lambda metrics: (metrics["steps"], metrics["drafted"], metrics["accepted"])  # noqa: E731
    for request, want in zip(requests, autoregressive_under_load()):
        got = outputs[request.request_id]
        assert list(got.tokens) == truncated_at_stop(want, request.stop_token_ids), request.request_id
        assert counts(got.metrics) == counts(reference[request.request_id].metrics), request.request_id
    assert sum(o.metrics["accepted"] for o in outputs.values()) > 0
    assert engine.stats()["prefill_calls"] == 0


@pytest.mark.parametrize("field, value", [("max_num_batched_tokens", 64), ("draft_kv_offload", True)])
def test_mixed_prefill_refuses_what_it_does_not_combine_with_naming_the_field(field, value):
    spec = SpecConfig(method="eagle", num_speculative_tokens=2)
    with pytest.raises(ValueError, match=f"EngineConfig.{field} = .+ is invalid with mixed_prefill_tokens = 8"):
        EngineConfig(mixed_prefill_tokens=8, spec=spec, **{field: value})
    with pytest.raises(ValueError, match="EngineConfig.enable_prefix_caching = True is invalid with "
                                         "mixed_prefill_tokens = 8: allowed False with speculation"):
        EngineConfig(mixed_prefill_tokens=8, spec=spec, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="EngineConfig.mixed_prefill_chunks = 0 is invalid"):
        EngineConfig(mixed_prefill_tokens=8, mixed_prefill_chunks=0)


def test_an_engine_whose_drafter_cannot_continue_a_prefill_refuses_what_continues_one():
    # MTP's state reads the target's hidden states of a window before the prompt's end, which a continued prefill
    # may not have computed: whatever continues a prefill is refused when the engine is configured.
    mtp = SpecConfig(method="mtp", num_speculative_tokens=2)
    for field, value in (("mixed_prefill_tokens", 8), ("max_num_batched_tokens", 8), ("enable_prefix_caching", True)):
        with pytest.raises(ValueError, match=f"EngineConfig.{field} = {value} is invalid with method 'mtp', whose "
                                             f"drafter defines no extend"):
            EngineConfig(spec=mtp, **{field: value})


def test_bench_serve_sweeps_mixed_prefill_settings_and_refuses_a_malformed_one(capsys):
    from specjax import cli
    from specjax.bench_serve import mixed_fields

    assert mixed_fields("off") == {}
    assert mixed_fields("128") == {"mixed_prefill_tokens": 128, "mixed_prefill_chunks": 1}
    assert mixed_fields("64x2") == {"mixed_prefill_tokens": 64, "mixed_prefill_chunks": 2}
    with pytest.raises(SystemExit):
        cli.main(["bench-serve", "--mixed-prefill", "off,128y2"])
    assert "--mixed-prefill '128y2' is invalid: allowed a comma-separated list of off and TOKENS[xCHUNKS]" in (
        capsys.readouterr().err)

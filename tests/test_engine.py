"""The serving engine: each request's output is what `generate` gives it alone, whatever runs beside it and
whenever it arrives (greedy: equal to autoregressive for every drafter; sampled: the target's distribution
exactly, chi-square with a negative control), one program for any mix of sampling settings, bad requests
refused alone."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.distributions import NUM_TOKENS, PROMPT, TINY, chi_square_pvalue, exact_joint, tiny_pair
from support.compiles import compiled_programs
from support.engine import (SPECS, autoregressive_under_load, drafter_for, load_config, load_group, random_requests,
                            serve_arriving, served_under_load, truncated_at_stop)
from support.models import EOS, target_and_drafts

from specjax import verify as verify_registry
from specjax.config import SamplingConfig, SpecConfig
from specjax.decoding import bucket, generate
from specjax.engine import Engine, EngineConfig, Request, RequestError, prefill_pieces
from specjax.verify import standard


@pytest.mark.loop
@pytest.mark.parametrize("name", [load_group(name) for name in SPECS])
def test_every_request_gets_its_autoregressive_output_under_load(name):
    """32 requests arriving at random steps in a random order, 4 slots: greedy output equal to generate's
    autoregressive output for each prompt alone, EOS and stop ids inside draft blocks."""
    requests = random_requests(32)
    _, outputs = served_under_load(name)
    for request, want in zip(requests, autoregressive_under_load()):
        got = outputs[request.request_id]
        assert list(got.tokens) == truncated_at_stop(want, request.stop_token_ids), request.request_id
        assert got.finish_reason == ("stop" if got.tokens[-1] in (EOS, *request.stop_token_ids) else "length")
    assert any(o.finish_reason == "stop" for o in outputs.values())
    assert any(o.finish_reason == "length" for o in outputs.values())
    if SPECS[name] is not None:  # per-request acceptance counts, as vLLM names them
        metrics = outputs["r1"].metrics
        assert metrics["mean_acceptance_length"] == 1 + metrics["accepted"] / metrics["steps"]
        assert sum(metrics["length_histogram"]) == metrics["steps"]
        assert sum(metrics["per_step_accepted"]) == metrics["accepted"]  # vLLM's detailed arrays
        assert sum(metrics["per_step_drafted"]) == metrics["drafted"]


# ------------------------------------------------------------------------------ exact distribution

ENGINE_ROWS = 8192  # requests of each sampling setting (support.distributions.NUM_ROWS on the CPU)
ENGINE_SAMPLINGS = (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5))


def engine_joint_counts(spec: SpecConfig, drafter, **options):
    """Counts of the first NUM_TOKENS tokens of ENGINE_ROWS requests of each of ENGINE_SAMPLINGS, served with
    64 greedy requests among them by one engine of 2,048 slots (options: EngineConfig fields over these); the greedy
    requests' tokens; every request's output; and the engine's stats."""
    configs = [SamplingConfig()] * 64 + [s for s in ENGINE_SAMPLINGS for _ in range(ENGINE_ROWS)]
    requests = [Request(request_id=str(i), prompt=tuple(PROMPT), max_tokens=NUM_TOKENS, sampling=sampling, seed=i)
                for i, sampling in enumerate(configs)]
    order = np.random.default_rng(0).permutation(len(requests))  # greedy and sampled requests interleaved
    config = dict(max_num_seqs=2048, max_model_len=32, spec=spec, steps_per_visit=8, max_prefill_batch=512) | options
    engine = Engine(tiny_pair()[0], EngineConfig(**config), drafter=drafter)
    outputs = {o.request_id: o for o in engine.run([requests[i] for i in order])}
    tokens = np.array([outputs[str(i)].tokens for i in range(len(requests))])
    codes = np.ravel_multi_index(tokens[64:].T, (TINY.vocab_size,) * NUM_TOKENS)
    return np.split(codes, len(ENGINE_SAMPLINGS)), tokens[:64], outputs, engine.stats()


@pytest.mark.loop
@pytest.mark.slow
@pytest.mark.parametrize("verifier", ["standard", "block"])
def test_sampled_requests_follow_the_target_distribution_beside_other_requests(verifier):
    spec = SpecConfig(num_speculative_tokens=2, rejection_sample_method=verifier, draft_sample_method="probabilistic")
    parts, greedy, _, _ = engine_joint_counts(spec, tiny_pair()[1])
    assert (greedy == generate(tiny_pair()[0], [PROMPT], max_new_tokens=NUM_TOKENS).tokens[0]).all()
    for sampling, codes in zip(ENGINE_SAMPLINGS, parts):
        counts = np.bincount(codes, minlength=TINY.vocab_size ** NUM_TOKENS)
        assert chi_square_pvalue(counts, exact_joint(tiny_pair()[0], sampling)) > 1e-4, sampling


def accept_all(target_probs, draft_tokens, draft_probs, keys):
    """Deliberately wrong: accepts every draft (then samples the bonus token from the target)."""
    n = np.full(draft_tokens.shape[:1], draft_tokens.shape[1], np.int32)
    return n, standard.verify(target_probs, draft_tokens, draft_probs, keys)[1]


@pytest.mark.loop
@pytest.mark.slow
def test_negative_control_the_engine_with_a_verifier_that_accepts_everything_fails(monkeypatch):
    monkeypatch.setitem(verify_registry.VERIFIERS, "accept_all", verify_registry.Verifier(chain=accept_all, tree=None))
    spec = SpecConfig(num_speculative_tokens=2, rejection_sample_method="accept_all",
                      draft_sample_method="probabilistic")
    parts, _, _, _ = engine_joint_counts(spec, tiny_pair()[1])
    counts = np.bincount(parts[0], minlength=TINY.vocab_size ** NUM_TOKENS)
    assert chi_square_pvalue(counts, exact_joint(tiny_pair()[0], ENGINE_SAMPLINGS[0])) < 1e-6


# ------------------------------------------------------------------------------------ one program

def without_eos(spec: SpecConfig) -> EngineConfig:
    """The load tests' engine with no EOS id (its outputs run to their budgets)."""
    return load_config(spec, eos_token_ids=())


@pytest.mark.loop
def test_one_step_program_serves_greedy_top_p_and_top_k_requests_together():
    target, drafts = target_and_drafts()
    engine = Engine(target, without_eos(SPECS["draft_model"]), drafter=drafts["perturbed"])
    settings = [dict(), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=5)]
    requests = [Request.make(f"r{i}", [3, 9, 27, i], 12, seed=i, **settings[i % 3]) for i in range(9)]
    for request in requests[:3]:  # the three kinds admitted together: the first program covers them all
        engine.add_request(request)
    outputs = engine.step()
    for request in requests[3:]:
        engine.add_request(request)
    outputs += engine.run()
    assert len(outputs) == 9
    programs = engine.step_programs()
    # One compiled step program for each count of busy slots stepped, whatever the mix of settings in them (0: an
    # engine of the same settings compiled it earlier in this process; engines share programs).
    assert set(programs.values()) <= {0, 1} and any(mode == engine.mode for mode, _ in programs)
    by_id = {o.request_id: o.tokens for o in outputs}
    autoregressive = generate(target, [[3, 9, 27, 0]], max_new_tokens=12).sequences()[0]
    assert list(by_id["r0"]) == autoregressive


@pytest.mark.loop
def test_engines_of_equal_settings_share_their_programs_and_another_setting_compiles_its_own():
    """A warmed engine serves without compiling. The engine's programs take its settings as static arguments and the
    weights and state as traced ones: a second
    engine of the same settings, over copies of the weights (a server restarted in one process), compiles nothing;
    one whose visits are longer compiles its step programs and shares the rest, which do not depend on it."""
    target, drafter = target_and_drafts()[0], drafter_for("eagle")
    requests = random_requests(8, seed=2)

    def warm_engine(target, drafter, **fields):  # warmup: every admission bucket and step program of 32-token prompts
        engine = Engine(target, load_config(SPECS["eagle"], **fields), drafter=drafter)
        engine.warmup(32)
        return engine

    engine = warm_engine(target, drafter)
    # warmup's contract: prompts of up to its length compile nothing, slot moves included. These prompts (2-14
    # tokens) would prefill at width 16: they pad to the warmed 32 instead, and decode as an unwarmed engine does.
    assert max(len(r.prompt) for r in requests) <= 16
    with compiled_programs() as compiled:
        want = serve_arriving(engine, requests)
    assert compiled == []
    cold = serve_arriving(Engine(target, load_config(SPECS["eagle"]), drafter=drafter), requests)
    assert {k: o.tokens for k, o in cold.items()} == {k: o.tokens for k, o in want.items()}
    copies = jax.tree.map(jnp.copy, (target, drafter))
    with compiled_programs() as compiled:
        got = serve_arriving(warm_engine(*copies), requests)
    assert compiled == []
    assert {k: o.tokens for k, o in got.items()} == {k: o.tokens for k, o in want.items()}
    with compiled_programs() as compiled:
        warm_engine(*copies, steps_per_visit=5)
    assert compiled and set(compiled) == {"run_steps"}, compiled


# ------------------------------------------------------------------------------------------ refusals

@pytest.fixture(scope="module")
def refusing_engine():
    """One engine for the refusal cases: a refused request leaves it serving the others, case after case. The draft
    model's load test engine (its programs; the good requests' 4 tokens hold no EOS)."""
    target, drafts = target_and_drafts()
    return Engine(target, load_config(SPECS["draft_model"]), drafter=drafts["perturbed"])


@pytest.mark.loop
@pytest.mark.parametrize("request_kwargs, message", [
    (dict(prompt=[]), r"request bad: prompt is empty: allowed at least one token id"),
    (dict(max_tokens=60), r"request bad: prompt \(3 tokens\) \+ max_tokens \(60\) \+ drafts scored per step \+ 1 "
                          r"\(4\) = 67 exceeds max_model_len 64: allowed at most 57 new tokens"),
    (dict(stop_token_ids=[999]), r"request bad: stop_token_ids has 999: allowed ids 0..127"),
    (dict(prompt=[1, 500]), r"request bad: prompt has token id 500: allowed 0..127"),
])
def test_a_bad_request_is_refused_alone_naming_the_field(request_kwargs, message, refusing_engine):
    engine = refusing_engine
    kwargs = dict(prompt=[1, 2, 3], max_tokens=4) | request_kwargs
    outputs = {o.request_id: o for o in engine.run([Request.make("good", [1, 2, 3], 4),
                                                    Request.make("bad", kwargs.pop("prompt"), **kwargs),
                                                    Request.make("also_good", [4, 5], 4)])}
    assert outputs["bad"].finish_reason == "error"
    assert outputs["bad"].tokens == ()
    assert re.search(message, outputs["bad"].error), outputs["bad"].error
    assert len(outputs["good"].tokens) == 4 and len(outputs["also_good"].tokens) == 4


def test_sampling_settings_out_of_range_are_refused_naming_the_field():
    with pytest.raises(RequestError, match=r"request r: SamplingConfig.temperature = -1.0 is invalid"):
        Request.make("r", [1], 4, temperature=-1.0)
    with pytest.raises(RequestError, match=r"request r: SamplingConfig.top_p = 1.5 is invalid"):
        Request.make("r", [1], 4, top_p=1.5)


@pytest.mark.loop
def test_an_aborted_request_frees_its_slot_for_the_next():
    """A running request aborted (a client that went away) ends with what it had; the one waiting for its slot
    then gets its full, autoregressive output."""
    target, _ = target_and_drafts()
    engine = Engine(target, EngineConfig(max_num_seqs=1, max_model_len=64, steps_per_visit=2))
    engine.add_request(Request.make("long", [3, 9, 27], 40))
    engine.add_request(Request.make("next", [5, 1], 10))
    assert engine.step() == []  # "long" runs two steps; "next" waits for the one slot
    engine.abort_request("long")
    outputs = {o.request_id: o for o in engine.run()}
    assert outputs["long"].finish_reason == "abort" and 0 < len(outputs["long"].tokens) < 40
    assert list(outputs["next"].tokens) == generate(target, [[5, 1]], max_new_tokens=10).sequences()[0]


@pytest.mark.loop
@pytest.mark.parametrize("counts, stepped_counts", [(None, {4, 2}), ((3, 8), {3})],
                         ids=["powers_of_two", "step_slot_counts"])
def test_busy_slots_are_kept_first_and_a_visit_steps_only_a_bucket_of_them(counts, stepped_counts):
    """When a request ends, the last busy slot's row moves into its slot: a visit then steps the smallest count of
    slots that holds the busy ones (a power of two, or one of step_slot_counts), and the moved request's output is
    unchanged."""
    target, drafts = target_and_drafts()
    engine = Engine(target, EngineConfig(max_num_seqs=8, max_model_len=64, spec=SPECS["draft_model"],
                                         steps_per_visit=2, step_slot_counts=counts), drafter=drafts["perturbed"])
    requests = [Request.make("short", [3, 9, 27], 2), Request.make("a", [5, 1], 14), Request.make("b", [2, 2, 2], 14)]
    outputs = {o.request_id: o.tokens for o in engine.run(requests)}
    expected = generate(target, [list(r.prompt) for r in requests], max_new_tokens=[r.max_tokens for r in requests])
    assert [list(outputs[r.request_id]) for r in requests] == expected.sequences()
    stepped = {rows for _, rows in engine.step_programs()}
    assert stepped == stepped_counts  # 3 busy slots, then 2 once "short" ended


@pytest.mark.parametrize("counts", [(), (4, 2, 8), (2, 4), (0, 8), (2, 2, 8), "8", (2.0, 8)])
def test_step_slot_counts_other_than_increasing_counts_ending_at_max_num_seqs_are_refused(counts):
    with pytest.raises(ValueError, match=r"EngineConfig.step_slot_counts = .+ is invalid: allowed None or increasing "
                                         r"integers >= 1 ending with max_num_seqs \(8\)"):
        EngineConfig(max_num_seqs=8, step_slot_counts=counts)
    assert EngineConfig(max_num_seqs=8, step_slot_counts=[1, 8]).step_slot_counts == (1, 8)


def test_prefill_pieces_pad_fewer_rows_than_one_call_by_more_than_a_call_costs():
    assert prefill_pieces(20, 2.0) == [16, 4] and prefill_pieces(51, 2.0) == [32, 16, 3]
    assert prefill_pieces(63, 2.0) == [63] and prefill_pieces(63, 0) == [32, 16, 8, 4, 2, 1]
    for count in range(1, 130):
        for call_rows in (0, 2.0, 8.0, float("inf")):
            pieces = prefill_pieces(count, call_rows)
            assert sum(pieces) == count and all(piece == bucket(piece) for piece in pieces[:-1]), (count, pieces)
            assert sum(bucket(piece) + call_rows for piece in pieces) <= bucket(count) + call_rows, (count, pieces)
        assert prefill_pieces(count, float("inf")) == [count]
    for bad in (-1, float("nan"), True, "2"):
        with pytest.raises(ValueError, match=r"EngineConfig.prefill_call_rows = .+ is invalid: allowed a number >= 0"):
            EngineConfig(prefill_call_rows=bad)


@pytest.mark.loop
def test_an_admission_split_into_several_prefills_gives_the_same_outputs():
    """Seven requests admitted together: one prefill of 8 rows, or (prefill_call_rows 0) calls of 4, 2 and 1 rows;
    every output is its autoregressive one either way."""
    target, drafts = target_and_drafts()
    requests = [Request.make(f"r{i}", [3, 9, 27, i], 6 + i) for i in range(7)]
    expected = generate(target, [list(r.prompt) for r in requests], max_new_tokens=[r.max_tokens for r in requests])
    for call_rows, calls, padded in ((0, 3, 0), (float("inf"), 1, 1)):
        config = EngineConfig(max_num_seqs=8, max_model_len=64, spec=SPECS["draft_model"], steps_per_visit=2,
                              prefill_call_rows=call_rows)
        engine = Engine(target, config, drafter=drafts["perturbed"])
        outputs = {o.request_id: o.tokens for o in engine.run(requests)}
        assert [list(outputs[r.request_id]) for r in requests] == expected.sequences(), call_rows
        assert engine.stats()["prefill_calls"] == calls and engine.stats()["prefill_padded_rows"] == padded

"""Prefill from an offset, prefix caching and chunked prefill (docs/serving.md "Prefix caching").

The building block: a proposer's state built from a cached prefix plus the rest equals the state built over
the whole prompt (caches equal over the filled slots, same first token, same drafts). On it, the engine's
prefix cache and chunked prefill: greedy outputs identical with them on and off and to autoregressive
decoding, hit counts exact on a constructed workload, eviction and reference counts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.engine import SPECS, drafter_for, load_config
from support.models import EOS, target_and_drafts

from specjax import decoding
from specjax.decoding import Prefix, generate, loop_arrays, pad_request
from specjax.engine import Engine, EngineConfig, Request
from specjax.proposers import Context, build_proposer
from specjax.verify.sampling import GREEDY

# The drafters whose state a prefill from an offset builds (support.engine.SPECS names them).
OFFSET_DRAFTERS = ("dflash", "draft_model", "draft_model_tree", "eagle", "eagle3", "eagle_tree", "medusa", "ngram")


def filled(cache, stop: int):
    """A KVCache's keys and values over slots [0, stop) of every row, as arrays per layer."""
    def part(x):
        return np.asarray(x[:, :, :stop] if x.ndim == 5 else x[:, :stop])
    k = cache.k if isinstance(cache.k, tuple) else (cache.k,)
    v = cache.v if isinstance(cache.v, tuple) else (cache.v,)
    return [part(x) for x in k + v]


@pytest.mark.parametrize("name", OFFSET_DRAFTERS)
def test_a_state_built_from_a_prefix_plus_the_rest_equals_the_state_built_in_one_go(name):
    """Rows of ragged prompts split at ragged starts (0 included: a prefill from an empty cache)."""
    target, drafter, spec = target_and_drafts()[0], drafter_for(name), SPECS[name]
    prompts = [list(range(3, 3 + n)) for n in (13, 9, 20, 5)]
    prompts = [[(7 * t + 3 * row) % 100 + 10 for t in p] for row, p in enumerate(prompts)]
    starts = np.array([8, 0, 16, 3], np.int32)
    request = pad_request(target, prompts, 6, lookahead=spec.num_draft_nodes + 1)
    (tokens, lengths, budgets, keys, sampling), mode = loop_arrays(request)
    proposer = build_proposer(spec, mode, request.cache_size, drafter)
    params = proposer.bind(drafter, target)
    batch = tokens.shape[0]
    starts = jnp.asarray(np.concatenate([starts, np.zeros(batch - len(starts), np.int32)]))

    @functools.partial(jax.jit, static_argnames="width")
    def init(prefix_target, prefix_draft, start, width):
        prefix = None if prefix_target is None else Prefix(target=prefix_target, draft=prefix_draft, start=start,
                                                           width=width)
        return decoding.speculative_init(target, params, tokens, lengths, budgets, keys, sampling,
                                         proposer=proposer, eos_token_ids=(), prefix=prefix)

    whole = init(None, None, None, 0)
    empty = target.create_cache(batch, request.cache_size)
    first = init(empty, proposer.new_cache(params, batch), jnp.zeros_like(starts), int(starts.max()))
    rest = init(first.decode.cache, proposer.prefix_cache(first.proposer), starts, tokens.shape[1])
    np.testing.assert_array_equal(rest.decode.tokens, whole.decode.tokens)  # the same first token
    np.testing.assert_array_equal(rest.decode.lengths, whole.decode.lengths)
    prompt_lens = lengths
    for row in range(len(prompts)):
        n = int(prompt_lens[row])
        for a, b in zip(filled(rest.decode.cache, 64), filled(whole.decode.cache, 64)):
            np.testing.assert_allclose(a[..., row, :n, :, :] if a.ndim == 5 else a[row, :n],
                                       b[..., row, :n, :, :] if b.ndim == 5 else b[row, :n], rtol=1e-5, atol=1e-5)
        if proposer.prefix_cache(whole.proposer) is not None:
            fill = n - 1  # every drafter's cache holds at least the prompt's positions but the last
            for a, b in zip(filled(proposer.prefix_cache(rest.proposer), fill),
                            filled(proposer.prefix_cache(whole.proposer), fill)):
                np.testing.assert_allclose(a[..., row, :, :, :] if a.ndim == 5 else a[row],
                                           b[..., row, :, :, :] if b.ndim == 5 else b[row], rtol=1e-5, atol=1e-5)
    context = Context(tokens=whole.decode.tokens, lengths=whole.decode.lengths, sampling=sampling)
    step_keys = jax.random.split(jax.random.key(1), batch)
    propose = jax.jit(lambda state: proposer.propose(params, state, context, step_keys)[0])
    np.testing.assert_array_equal(propose(rest.proposer)[:len(prompts)], propose(whole.proposer)[:len(prompts)])


@pytest.mark.parametrize("name", ["eagle", "dflash", "draft_model"])
def test_the_entry_before_a_prefix_end_depends_on_the_next_token_only_where_the_drafter_says_so(name):
    """A prefix of 8 positions prefilled from prompt A, the rest from prompt B (equal to A but from position 8
    on): the drafter's cache differs from B's own prefill at slot 7 exactly where draft_kv_reads_next_token
    (EAGLE: pair 7 holds A's token 8), and nowhere for the others: why the engine drops EAGLE's last block."""
    target, drafter, spec = target_and_drafts()[0], drafter_for(name), SPECS[name]
    prompt_a = [(5 * t) % 90 + 10 for t in range(14)]
    prompt_b = prompt_a[:8] + [(3 * t) % 90 + 11 for t in range(6)]
    request = pad_request(target, [prompt_a, prompt_b], 4, lookahead=spec.num_draft_nodes + 1)
    (tokens, lengths, budgets, keys, sampling), mode = loop_arrays(request)
    proposer = build_proposer(spec, mode, request.cache_size, drafter)
    params = proposer.bind(drafter, target)

    @functools.partial(jax.jit, static_argnames="width")
    def init(tokens, prefix_target, prefix_draft, start, width):
        prefix = None if prefix_target is None else Prefix(target=prefix_target, draft=prefix_draft, start=start,
                                                           width=width)
        return decoding.speculative_init(target, params, tokens, lengths, budgets, keys, sampling,
                                         proposer=proposer, eos_token_ids=(), prefix=prefix)

    swapped = tokens[::-1]  # row 0 prompt B, row 1 prompt A: each row's prefix from the other prompt
    start = jnp.full((2,), 8, jnp.int32)
    first = init(swapped, target.create_cache(2, request.cache_size), proposer.new_cache(params, 2),
                 jnp.zeros_like(start), 8)
    mixed = init(tokens, first.decode.cache, proposer.prefix_cache(first.proposer), start, tokens.shape[1])
    whole = init(tokens, None, None, None, 0)
    differs = [np.abs(a - b).max(axis=tuple(i for i in range(a.ndim) if i != a.ndim - 3)) > 1e-4
               for a, b in zip(filled(proposer.prefix_cache(mixed.proposer), 13),
                               filled(proposer.prefix_cache(whole.proposer), 13))]
    slots = sorted({int(i) for d in differs for i in np.flatnonzero(d)})
    assert slots == ([7] if proposer.draft_kv_reads_next_token else [])


# ------------------------------------------------------------------------------------- the engine

def shared_prefix_requests(count: int = 8, seed: int = 0) -> list[Request]:
    """Two system prompts of 37 tokens, each request one of them plus a unique suffix of 2-9 tokens."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(10, 120, 37).tolist() for _ in range(2)]
    return [Request.make(f"r{i}", systems[i % 2] + rng.integers(10, 120, int(rng.integers(2, 10))).tolist(),
                         int(rng.integers(4, 10))) for i in range(count)]


def autoregressive(requests: list[Request]) -> dict:
    target = target_and_drafts()[0]
    out = generate(target, [list(r.prompt) for r in requests], max_new_tokens=[r.max_tokens for r in requests],
                   eos_token_ids=(EOS,)).sequences()
    return {r.request_id: want for r, want in zip(requests, out)}


def serve(name: str | None, requests: list[Request], **config) -> tuple[dict, Engine]:
    """Outputs by id of an engine with the drafter of `name` (None: autoregressive) and these config fields: the
    load tests' engine (their programs), blocks of 8."""
    config = load_config(None if name is None else SPECS[name], **({"block_size": 8} | config))
    engine = Engine(target_and_drafts()[0], config, drafter=None if name is None else drafter_for(name))
    return {o.request_id: o for o in engine.run(requests)}, engine


@pytest.mark.loop
@pytest.mark.parametrize("name", ["eagle", "dflash", "draft_model", "ngram"])
def test_greedy_outputs_are_identical_with_the_prefix_cache_on_and_off(name):
    """Requests sharing system prompts: off, on (EAGLE: with its tail-block drop) and on without the drop
    (EAGLE only: the others have no drop), each request's tokens the autoregressive ones; the cache hits."""
    requests = shared_prefix_requests()
    want = autoregressive(requests)
    runs = [dict(), dict(enable_prefix_caching=True)]
    if name == "eagle":
        runs.append(dict(enable_prefix_caching=True, disable_eagle_block_drop=True))
    for config in runs:
        outputs, engine = serve(name, requests, **config)
        assert {k: list(o.tokens) for k, o in outputs.items()} == want, config
        if config:
            stats = engine.stats()["prefix_cache"]
            assert stats["hit_tokens"] > 0 and stats["hit_tokens"] == sum(o.num_cached_tokens for o in outputs.values())


@pytest.mark.loop
def test_sampled_outputs_are_identical_with_the_prefix_cache_on_and_off():
    """Sampled requests draw from their seeds numbered by their own tokens and steps: the same tokens whether
    their prefix was prefilled or copied from the pool (EAGLE with its tail-block drop: the drafter's state is
    the same, so are its drafts and the steps. Without the drop the drafts may differ, and with them which
    step draws which token: the same distribution, not the same tokens)."""
    requests = [Request.make(r.request_id, r.prompt, r.max_tokens, temperature=0.8, top_p=0.9, seed=i)
                for i, r in enumerate(shared_prefix_requests())]
    runs = [serve("eagle", requests, **config)[0] for config in (dict(), dict(enable_prefix_caching=True))]
    tokens = [{k: o.tokens for k, o in outputs.items()} for outputs in runs]
    assert tokens[0] == tokens[1]
    assert sum(o.num_cached_tokens for o in runs[1].values()) > 0


def constructed_workload() -> list[Request]:
    """A 12-token system prompt S (3 blocks of 4), served one request at a time."""
    system = list(range(20, 32))
    return [Request.make("a", system + [1, 2], 3),  # 13 tokens before its last: 3 full blocks, none cached yet
            Request.make("b", system + [3, 4, 5], 3),  # 3 blocks, all of S's
            Request.make("c", system[:8] + [9, 9, 9, 9, 9], 3),  # 3 blocks, the first 2 S's
            Request.make("d", system + [1, 2], 3),  # a's prompt again: its 3 blocks
            Request.make("e", system[:3], 3)]  # 2 tokens before its last: no full block


@pytest.mark.parametrize("name, drop, cached", [
    ("ngram", False, [0, 12, 8, 12, 0]),
    ("eagle", False, [0, 12, 8, 12, 0]),  # disable_eagle_block_drop
    ("eagle", True, [0, 8, 4, 8, 0]),  # the last matched block recomputed
])
@pytest.mark.loop
def test_hit_counts_are_exact_on_a_constructed_workload(name, drop, cached):
    requests = constructed_workload()
    outputs, engine = serve(name, requests, max_num_seqs=1, max_prefill_batch=1, block_size=4,
                            enable_prefix_caching=True, disable_eagle_block_drop=name == "eagle" and not drop)
    assert [outputs[r.request_id].num_cached_tokens for r in requests] == cached
    stats = engine.stats()["prefix_cache"]
    queried = [3, 3, 3, 3, 0]
    assert stats["requests"] == 5 and stats["queried_blocks"] == sum(queried)
    assert stats["queried_tokens"] == sum(len(r.prompt) for r in requests)
    assert stats["hit_tokens"] == sum(cached) and stats["hit_blocks"] == sum(cached) // 4
    assert stats["hit_rate"] == sum(cached) / sum(len(r.prompt) for r in requests)
    assert stats["dropped_blocks"] == (3 if drop else 0)
    # a stores S's 3 blocks; c its third (S[:8] + [9, 9, 9, 9]); with the drop b and d store nothing new (the
    # dropped block is recomputed, and its key is in the pool already), c recomputes S's second block.
    assert stats["stored_blocks"] == 4
    assert {k: list(o.tokens) for k, o in outputs.items()} == autoregressive(requests)


@pytest.mark.loop
def test_eviction_under_a_small_pool_keeps_outputs_right():
    """A pool of 4 blocks of 4 under prompts of 5 distinct prefixes, each served twice: blocks are evicted and
    stored again, every output stays the autoregressive one."""
    rng = np.random.default_rng(3)
    prefixes = [rng.integers(10, 120, 12).tolist() for _ in range(5)]
    requests = [Request.make(f"r{i}", prefixes[i % 5] + [int(rng.integers(10, 120))], 4) for i in range(10)]
    outputs, engine = serve("eagle", requests, max_num_seqs=2, block_size=4, num_prefix_blocks=4,
                            enable_prefix_caching=True, disable_eagle_block_drop=True)
    stats = engine.stats()["prefix_cache"]
    assert stats["evicted_blocks"] > 0
    assert {k: list(o.tokens) for k, o in outputs.items()} == autoregressive(requests)


@pytest.mark.loop
def test_blocks_held_by_running_requests_are_never_evicted():
    """A pool of 3 blocks, all held by a long request: a request with another prefix admitted beside it stores
    nothing (and evicts nothing); once the long one ends its blocks are free and the next request evicts them."""
    long = Request.make("long", list(range(20, 33)), 30)  # 12 tokens before its last: 3 blocks of 4
    other = Request.make("other", list(range(40, 53)), 2)
    again = Request.make("again", list(range(40, 53)), 2)
    target = target_and_drafts()[0]
    engine = Engine(target, load_config(None, block_size=4, num_prefix_blocks=3, enable_prefix_caching=True))
    engine.add_request(long)
    engine.step()
    held = dict(engine.prefix_cache.table.by_key)
    assert len(held) == 3 and all(engine.prefix_cache.table.refs[b] == 1 for b in held.values())
    engine.add_request(other)
    outputs = {}
    while "other" not in outputs:
        outputs.update({o.request_id: o for o in engine.step()})
    assert engine.prefix_cache.table.by_key == held  # the long request's blocks, untouched
    stats = engine.stats()["prefix_cache"]
    assert stats["full_pool"] == 3 and stats["evicted_blocks"] == 0
    outputs.update({o.request_id: o for o in engine.run([])})  # the long request ends: its blocks are released
    assert not engine.prefix_cache.table.refs.any()
    outputs.update({o.request_id: o for o in engine.run([again])})
    assert engine.stats()["prefix_cache"]["evicted_blocks"] == 3
    assert {k: list(o.tokens) for k, o in outputs.items()} == autoregressive([long, other, again])


@pytest.mark.loop
@pytest.mark.parametrize("name", [None, "eagle", "dflash"])
def test_chunked_prefill_gives_the_whole_prefill_outputs(name):
    """max_num_batched_tokens 16 under prompts of up to 46 tokens: long prompts prefilled in chunks of 16, 8
    (a power of two at most what is left of a visit's budget), with and without prefix caching."""
    requests = shared_prefix_requests()
    want = autoregressive(requests)
    for config in (dict(), dict(enable_prefix_caching=True)):
        outputs, engine = serve(name, requests, max_num_batched_tokens=16, **config)
        assert {k: list(o.tokens) for k, o in outputs.items()} == want, config


@pytest.mark.loop
def test_a_long_prompt_prefilled_in_chunks_does_not_stall_the_running_requests():
    """A running request gets tokens at the visits between the chunks of a long prompt admitted after it."""
    short = Request.make("short", [5, 1, 2], 20)
    long = Request.make("long", list(range(10, 70)), 2)
    target = target_and_drafts()[0]
    engine = Engine(target, EngineConfig(max_num_seqs=2, max_model_len=96, steps_per_visit=1, eos_token_ids=(EOS,),
                                         max_num_batched_tokens=16))
    engine.add_request(short)
    engine.step()
    engine.add_request(long)
    outputs = {o.request_id: o for o in engine.run([])}
    between = [t for t in outputs["short"].token_times if t < outputs["long"].first_token_time]
    assert len(between) >= 4  # one token a visit while the 60-token prompt is prefilled 16 tokens a visit
    assert {k: list(o.tokens) for k, o in outputs.items()} == autoregressive([short, long])


@pytest.mark.parametrize("fields, message", [
    (dict(block_size=0), r"EngineConfig.block_size = 0 is invalid: allowed an integer >= 1"),
    (dict(num_prefix_blocks=-1), r"EngineConfig.num_prefix_blocks = -1 is invalid: allowed an integer >= 1"),
    (dict(max_num_batched_tokens=0), r"EngineConfig.max_num_batched_tokens = 0 is invalid: allowed None or an integer"),
    (dict(visit_ends=0), r"EngineConfig.visit_ends = 0 is invalid: allowed None or an integer >= 1"),
    (dict(enable_prefix_caching="yes"), r"EngineConfig.enable_prefix_caching = 'yes' is invalid: allowed True or False"),
    (dict(disable_eagle_block_drop=True), r"EngineConfig.disable_eagle_block_drop = True is invalid without "
                                          r"enable_prefix_caching"),
])
def test_a_bad_prefix_or_chunk_setting_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


# ------------------------------------------------------------------------------------- the load script

def test_the_shared_prefix_workload_is_system_prompts_plus_suffixes_of_their_own():
    from specjax.bench_serve import shared_prefix_prompts

    base = [list(range(100 * i, 100 * i + 64)) for i in range(20)]
    prompts = shared_prefix_prompts(base, 12, num_prefixes=3, prefix_len=80, suffix_len=10)
    systems = {tuple(p[:80]) for p in prompts}
    assert len(systems) == 3 and all(len(p) == 90 for p in prompts)
    assert [p[:80] for p in prompts[:3]] == [list(range(64)) + list(range(100, 116)),
                                            list(range(116, 164)) + list(range(200, 232)),
                                            list(range(232, 264)) + list(range(300, 348))]
    suffixes = [tuple(p[80:]) for p in prompts]
    assert len(set(suffixes)) == 12 and not set(suffixes[0]) & set().union(*systems)
    with pytest.raises(ValueError, match="--num-prefixes 30 x --prefix-len 80 needs more prompt tokens"):
        shared_prefix_prompts(base, 12, num_prefixes=30, prefix_len=80, suffix_len=10)


def test_specjax_bench_serve_is_the_scripts_parser(capsys):
    from specjax import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench-serve", "--help"])
    assert exit_info.value.code == 0 and "--workload {prompts,shared-prefix}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["bench-serve", "--prefix-caching", "on"])
    assert "--prefix-caching 'on' is invalid: allowed a comma-separated list of ['off', 'drop', 'keep']" in (
        capsys.readouterr().err)

"""Async scheduling (EngineConfig.async_scheduling, docs/serving.md "Async scheduling"): each visit dispatched from
the engine's thread before the host reads the one before it. Outputs identical with it on and off for every kind
of drafter (chain, tree, block, n-gram, none) under arriving requests, with prefix caching, chunked prefill and
aborts, and through the server's engine thread; bad settings refused naming the field."""

import asyncio
import dataclasses

import numpy as np
import pytest
from support.engine import (SPECS, drafter_for, load_config, load_group, random_requests, serve_arriving,
                            served_under_load)
from support.models import target_and_drafts

from specjax import cli
from specjax.config import ConfigError, SpecConfig
from specjax.engine import Engine, EngineConfig
from specjax.serve import FLAGS, EngineRunner, ServeConfig, load_serve_config


def asynchronous(name: str, config: EngineConfig) -> Engine:
    return Engine(target_and_drafts()[0], dataclasses.replace(config, async_scheduling=True), drafter=drafter_for(name))


def assert_same_outputs(want: dict, got: dict, requests) -> None:
    """Tokens and finish reasons equal; acceptance counts too for requests that end on the device (EOS, budget):
    one that ends at a stop id the device does not know counts the steps its row ran to the end of that visit,
    and visits end at other steps when requests are admitted a visit later."""
    assert sorted(got) == sorted(want)
    for request in requests:
        a, b = want[request.request_id], got[request.request_id]
        assert (b.tokens, b.finish_reason) == (a.tokens, a.finish_reason), request.request_id
        if not request.stop_token_ids:
            assert repr(b.metrics) == repr(a.metrics), request.request_id  # repr: a row without steps has NaN rates


@pytest.mark.loop
@pytest.mark.parametrize("name", [load_group(name) for name in ("autoregressive", "eagle", "eagle_tree", "dflash",
                                                                 "ngram")])
def test_outputs_are_identical_with_async_scheduling_on_and_off(name):
    """32 requests arriving at random steps in a random order into 4 slots (ends read a visit late, slots refilled
    a visit late, rows compacted while the next visit holds the state): the same outputs as without
    (tests/test_engine.py's load run, the same engine's programs)."""
    requests = random_requests(32)
    sync, want = served_under_load(name)
    engine = asynchronous(name, sync.config)
    assert_same_outputs(want, serve_arriving(engine, requests), requests)
    assert not engine.has_work() and not engine.running
    stats = engine.stats()
    assert stats["visits"] > 0 and stats["busy_slot_steps"] <= stats["slot_steps"]


@pytest.mark.loop
def test_async_scheduling_with_prefix_caching_chunked_prefill_and_aborts_keeps_outputs():
    """Rows that enter through the prefix cache and chunked prefill, and requests aborted while a visit holds their
    slot: the others' outputs as without async scheduling, the aborted ones ended as 'abort', every slot freed."""
    rng = np.random.default_rng(1)
    system = rng.integers(1, 100, 24).tolist()
    requests = [dataclasses.replace(r, prompt=tuple(system + list(r.prompt)), max_tokens=max(r.max_tokens, 8))
                for r in random_requests(12)]
    config = load_config(SPECS["eagle"], enable_prefix_caching=True, block_size=8, max_num_batched_tokens=16)
    aborted = {"r4", "r9"}

    def serve(engine):
        outputs, pending = {}, list(requests)
        while pending or engine.has_work():
            if pending:
                engine.add_request(pending.pop(0))
            if len(outputs) == 3:  # requests in slots by then, some in the visit in flight
                for request_id in aborted:
                    engine.abort_request(request_id)
            outputs.update({o.request_id: o for o in engine.step()})
        return outputs

    want = serve(Engine(target_and_drafts()[0], config, drafter=drafter_for("eagle")))
    engine = asynchronous("eagle", config)
    got = serve(engine)
    assert {got[r].finish_reason for r in aborted} == {"abort"}
    assert_same_outputs({k: v for k, v in want.items() if k not in aborted},
                        {k: v for k, v in got.items() if k not in aborted},
                        [r for r in requests if r.request_id not in aborted])
    assert engine.stats()["prefix_cache"]["hit_tokens"] > 0
    assert not engine.running and engine.prefix_cache.stats.as_dict()["hit_tokens"] > 0


def test_async_scheduling_is_refused_with_draft_kv_offload_naming_the_field():
    with pytest.raises(ValueError, match=r"EngineConfig.async_scheduling = True is invalid with draft_kv_offload = "
                                         r"True: allowed with one of them at most"):
        EngineConfig(spec=SpecConfig(method="eagle"), draft_kv_offload=True, async_scheduling=True)
    with pytest.raises(ValueError, match=r"EngineConfig.async_scheduling = 1 is invalid: allowed True or False"):
        EngineConfig(async_scheduling=1)


@pytest.mark.loop
@pytest.mark.xdist_group("load-eagle")  # served_under_load("eagle")'s worker
def test_the_servers_engine_thread_with_async_scheduling_streams_each_requests_output():
    """EngineRunner (the server's engine thread, no HTTP) on an async engine: 16 clients at once, each request's
    stream and end the same as the in-process engine's without async scheduling."""
    requests = random_requests(16)
    _, want = served_under_load("eagle")
    runner = EngineRunner(target_and_drafts()[0], load_config(SPECS["eagle"], async_scheduling=True),
                          drafter_for("eagle"), admit_wait_s=0.0)
    got = {}

    async def clients():
        async def one(request):
            queue, tokens = runner.submit(request), []
            while True:
                kind, value = await queue.get()
                if kind != "tokens":
                    got[request.request_id] = (tokens, value)
                    return
                tokens += value

        await asyncio.gather(*(one(request) for request in requests))

    runner.start()
    try:
        asyncio.run(clients())
    finally:
        runner.stop()
    for request in requests:
        tokens, output = got[request.request_id]
        assert tokens == list(output.tokens) == list(want[request.request_id].tokens), request.request_id
        assert output.finish_reason == want[request.request_id].finish_reason


def test_the_server_takes_async_scheduling_from_its_flag_and_refuses_a_bad_value():
    args = cli.build_parser().parse_args(["serve", "--async-scheduling"])
    assert load_serve_config(None, {name: getattr(args, name) for name in FLAGS}).async_scheduling is True
    assert ServeConfig().async_scheduling is False
    with pytest.raises(ConfigError, match=r"ServeConfig.async_scheduling"):
        ServeConfig(async_scheduling="yes")

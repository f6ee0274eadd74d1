"""Draft KV offload (EngineConfig.draft_kv_offload, docs/serving.md "Draft KV offload"): the drafter's KV cache in
pinned host memory between visits. Outputs identical with it on and off for every drafter that keeps a cache,
under arriving requests (and under adaptive verification: tests/test_adaptive.py's engine test); the state holds no
draft K or V on the device; bad settings refused naming the field."""

import dataclasses
import types

import jax
import numpy as np
import pytest
from support.engine import (SPECS, drafter_for, load_config, load_group, random_requests, serve_arriving,
                            served_under_load)
from support.models import target_and_drafts

from specjax.config import SpecConfig
from specjax.engine import Engine, EngineConfig
from specjax.models.kv_cache import KVCache

OFFLOADED = ("eagle", "dflash", "draft_model", "eagle_tree")


def offloaded(name: str, config: EngineConfig) -> Engine:
    """The engine of `config` with the draft KV cache offloaded."""
    return Engine(target_and_drafts()[0], dataclasses.replace(config, draft_kv_offload=True), drafter=drafter_for(name))


@pytest.mark.loop
@pytest.mark.parametrize("name", [load_group(name) for name in OFFLOADED])
def test_outputs_are_identical_with_draft_kv_offload_on_and_off(name):
    """32 requests arriving at random steps in a random order into 4 slots (rows admitted, compacted, stepped in
    buckets of 1, 2 and 4): the same tokens, finish reasons and acceptance counts with offload on and off (off:
    tests/test_engine.py's load run, the same engine)."""
    requests = random_requests(32)
    off, want = served_under_load(name)
    on = offloaded(name, off.config)
    got = serve_arriving(on, requests)
    for request in requests:
        a, b = want[request.request_id], got[request.request_id]
        assert (b.tokens, b.finish_reason) == (a.tokens, a.finish_reason), request.request_id
        assert repr(b.metrics) == repr(a.metrics), request.request_id  # repr: a row without steps has NaN rates
    stats = on.stats()["draft_kv_offload"]
    assert stats["bytes_per_slot"] == draft_kv_bytes(off) and stats["slots"] == 4
    assert stats["bytes_to_device"] > 0 and stats["bytes_to_host"] > stats["bytes_to_device"]
    # No draft K or V left in the device state: the slots' buffers live in pinned host memory.
    assert all(buffer.sharding.memory_kind == "pinned_host" for buffer in on.draft_kv.buffers)
    row = stats["bytes_per_slot"] // 4  # float32 elements
    assert on.draft_kv.buffers[0].shape == (row,)
    assert sum(x.size for x in jax.tree.leaves(on.state.proposer)) + 4 * row == sum(
        x.size for x in jax.tree.leaves(off.state.proposer))


def draft_kv_bytes(engine: Engine) -> int:
    """Bytes of one slot's draft keys and values in an engine without offload: its proposer state's KVCaches."""
    caches = [c for c in jax.tree.leaves(engine.state.proposer, is_leaf=lambda x: isinstance(x, KVCache))
              if isinstance(c, KVCache)]
    return sum(x.nbytes for c in caches for x in jax.tree.leaves((c.k, c.v))) // engine.config.max_num_seqs


@pytest.mark.loop
def test_offload_with_prefix_caching_and_chunked_prefill_keeps_outputs():
    """Rows that enter through the prefix cache and through chunked prefill reach their host buffers too."""
    rng = np.random.default_rng(1)
    system = rng.integers(1, 100, 24).tolist()
    requests = [dataclasses.replace(r, prompt=tuple(system + list(r.prompt))) for r in random_requests(12)]
    config = load_config(SPECS["eagle"], enable_prefix_caching=True, block_size=8, max_num_batched_tokens=16)
    off, on = Engine(target_and_drafts()[0], config, drafter=drafter_for("eagle")), offloaded("eagle", config)
    want, got = serve_arriving(off, requests), serve_arriving(on, requests)
    assert {k: v.tokens for k, v in got.items()} == {k: v.tokens for k, v in want.items()}
    assert on.stats()["prefix_cache"]["hit_tokens"] > 0


def test_offload_is_refused_without_speculation_or_a_drafter_cache_naming_the_field():
    with pytest.raises(ValueError, match=r"EngineConfig.draft_kv_offload = True is invalid without speculation"):
        EngineConfig(draft_kv_offload=True)
    with pytest.raises(ValueError, match=r"EngineConfig.draft_kv_offload = 1 is invalid: allowed True or False"):
        EngineConfig(spec=SpecConfig(method="eagle"), draft_kv_offload=1)
    target, _ = target_and_drafts()
    with pytest.raises(ValueError, match=r"draft_kv_offload = True is invalid for method 'medusa': its drafter keeps "
                                         r"no KV cache; allowed for"):
        Engine(target, EngineConfig(max_num_seqs=2, max_model_len=64, spec=SPECS["medusa"], draft_kv_offload=True),
               drafter=drafter_for("medusa"))


def test_a_device_without_pinned_host_memory_is_refused_naming_the_field(monkeypatch):
    assert "pinned_host" in [m.kind for m in jax.devices()[0].addressable_memories()]  # so the tests run the path
    memories = [types.SimpleNamespace(kind="device")]
    device = types.SimpleNamespace(platform="fake", addressable_memories=lambda: memories)
    monkeypatch.setattr(jax, "devices", lambda *args: [device])
    target, _ = target_and_drafts()
    with pytest.raises(ValueError, match=r"EngineConfig.draft_kv_offload = True is invalid on fake device .*memory "
                                         r"kinds are \['device'\]; allowed only where 'pinned_host' is one of them"):
        Engine(target, EngineConfig(max_num_seqs=2, max_model_len=64, spec=SPECS["eagle"], draft_kv_offload=True),
               drafter=drafter_for("eagle"))

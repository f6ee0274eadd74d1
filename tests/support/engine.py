"""The engine tests' shared pieces: the spec of each drafter the engine serves (SPECS) and its drafter, random
requests (some with a stop id), serving them as they arrive a few at a time between engine steps, and the load
run several files check (one engine per drafter, served once per worker)."""

import functools

import numpy as np
import pytest

from specjax.config import SpecConfig
from specjax.decoding import generate
from specjax.engine import Engine, EngineConfig, Request
from specjax.models.dflash import init_dflash

from support.models import EOS, dflash_config, head_for, medusa_for, target_and_drafts

STOP = 5  # a stop id some requests add to the EOS


def drafter_for(name: str):
    target, drafts = target_and_drafts()
    if name in ("draft_model", "draft_model_tree"):
        return drafts["perturbed"]
    if name.startswith("medusa"):
        return medusa_for(target, num_heads=3, scale=0.05)
    if name == "dflash":
        return init_dflash(dflash_config(target.config, (0, 1), 8))
    if name in ("ngram", "autoregressive"):
        return None
    return head_for(name.removesuffix("_tree"))


SPECS = {
    "autoregressive": None,
    "draft_model": SpecConfig(method="draft_model", num_speculative_tokens=3),
    "draft_model_tree": SpecConfig(method="draft_model", num_speculative_tokens=3, total_tokens=6, tree_top_k=2),
    "eagle": SpecConfig(method="eagle", num_speculative_tokens=3),
    "eagle_tree": SpecConfig(method="eagle", num_speculative_tokens=3, total_tokens=6, tree_top_k=2),
    "eagle3": SpecConfig(method="eagle3", num_speculative_tokens=3),
    "medusa": SpecConfig(method="medusa", num_speculative_tokens=3),
    "medusa_tree": SpecConfig(method="medusa", num_speculative_tokens=3,
                              speculative_token_tree=((0,), (1,), (0, 0), (0, 1), (0, 0, 0))),
    "ngram": SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3),
    "dflash": SpecConfig(method="dflash", num_speculative_tokens=3),
}


def random_requests(count: int, seed: int = 0) -> list[Request]:
    """Ragged prompts (some repeating, so that n-gram lookup drafts), budgets 1..20, every third with a stop id."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(count):
        length = int(rng.integers(2, 15))
        prompt = rng.integers(1, 100, length).tolist() if i % 2 else ([3, 9, 27] * 5)[:length]
        requests.append(Request.make(f"r{i}", prompt, int(rng.integers(1, 21)),
                                     stop_token_ids=(STOP,) if i % 3 == 0 else ()))
    return requests


def serve_arriving(engine: Engine, requests: list[Request], seed: int = 0) -> dict:
    """Adds the requests a few at a time between engine steps, in a random order; outputs by id."""
    rng = np.random.default_rng(seed)
    pending = [requests[i] for i in rng.permutation(len(requests))]
    outputs = {}
    while pending or engine.has_work():
        for _ in range(int(rng.integers(0, 4))):
            if pending:
                engine.add_request(pending.pop())
        outputs.update({o.request_id: o for o in engine.step()})
    return outputs


def truncated_at_stop(tokens: list[int], stop: tuple[int, ...]) -> list[int]:
    hits = [i for i, t in enumerate(tokens) if t in stop]
    return tokens[:hits[0] + 1] if hits else tokens


def load_config(spec: SpecConfig | None, **fields) -> EngineConfig:
    """The engine of the load tests (4 slots, 3 steps a visit, up to 4 rows prefilled together), fields overridden."""
    return EngineConfig(**(dict(max_num_seqs=4, max_model_len=64, spec=spec, eos_token_ids=(EOS,), steps_per_visit=3,
                                max_prefill_batch=4) | fields))


@functools.cache
def served_under_load(name: str) -> tuple[Engine, dict]:
    """The engine of SPECS[name] after serving random_requests(32) as they arrive, and its outputs by id: checked
    against autoregressive decoding (tests/test_engine.py) and against the same engine with the draft KV cache
    offloaded (tests/test_offload.py). Both files mark these cases xdist_group("load-NAME"): one worker, one run."""
    engine = Engine(target_and_drafts()[0], load_config(SPECS[name]), drafter=drafter_for(name))
    return engine, serve_arriving(engine, random_requests(32))


def load_group(name: str):
    """The case of `name` in the xdist group of served_under_load(name)."""
    return pytest.param(name, marks=pytest.mark.xdist_group(f"load-{name}"))


@functools.cache
def autoregressive_under_load() -> list[list[int]]:
    """The target's greedy output for random_requests(32) (each prompt alone), stopping at EOS only."""
    requests = random_requests(32)
    return generate(target_and_drafts()[0], [list(r.prompt) for r in requests],
                    max_new_tokens=[r.max_tokens for r in requests], eos_token_ids=(EOS,)).sequences()

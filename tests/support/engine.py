"""The engine tests' shared pieces: the spec of each drafter the engine serves (SPECS) and its drafter, random
requests (some with a stop id), and serving them as they arrive a few at a time between engine steps."""

import numpy as np

from specjax.config import SpecConfig
from specjax.engine import Engine, Request
from specjax.models.dflash import init_dflash

from support.models import dflash_config, head_for, medusa_for, target_and_drafts

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

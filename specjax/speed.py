"""Decoding speed at a released model's shapes: autoregressive against speculative decoding, on one device.

    specjax speed [--shape 8b] [--batches 1,16] [--prompt-len 128] [--new-tokens 128]
        [--acceptance-length 4] [--num-speculative-tokens 5] [--output DIR]

Random weights and synthetic acceptance: the target has Llama-3.1-8B's shapes and the drafter those
of its EAGLE-1 head, with random bfloat16 weights (speed does not depend on their values), and the
verifier accepts a set mean of tau tokens a step (rejection_sample_method 'synthetic'). The table says
what speculation at that acceptance buys on this device against the HBM floor of autoregressive
decoding; it says nothing about text. The bundled models are too small for that: their steps are
bound by kernel launches, not by reading weights. 8B shapes need a GPU; elsewhere the table is
skipped with a line saying so (`--shape tiny` runs anywhere, for tests).

scripts/bench_decode.py builds on these pieces for its batch, prompt-length and drafter sweeps.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax import benchmarking
from specjax.config import ModelConfig, SamplingConfig, SpecConfig
from specjax.decoding import decode_loop, loop_arrays, pad_request, speculative_loop
from specjax.models.transformer import init_model, to_decoding_layout
from specjax.proposers import PROPOSERS, build_proposer, proposer_class
from specjax.proposers.base import SHAPED_DRAFT_VOCAB
from specjax.verify.sampling import SamplingMode

FR_SUFFIX = "_fr"  # a drafter name's variant over a draft vocabulary (FR-Spec)
# The drafters a speed table can time: every method whose proposer builds a shaped drafter, and NAME_fr for
# those that take a draft vocabulary; name: what it is at 8b (mtp: at mimo7b).
DRAFTERS = {name + suffix: (cls.shaped_description if not suffix else
                            f"{cls.shaped_description} over {SHAPED_DRAFT_VOCAB} draft ids (FR-Spec)")
            for name, cls in PROPOSERS.items() if cls.shaped_description is not None
            for suffix in ("", FR_SUFFIX)[:1 + cls.takes_draft_vocabulary]}
GREEDY = SamplingConfig()


SHAPE_PREFIX = "shape:"  # `shape:8b` in place of a model folder: random weights at benchmarking.SHAPES' sizes


def shaped_models(name: str, method: str | None = None):
    """(target, tokenizer, drafter) for `shape:NAME`: random weights at benchmarking.SHAPES[NAME] (the drafter
    as build_drafter makes it; none for a method without weights), and a word-level tokenizer whose id i is the word '<i>', so
    that the engine and the server can be loaded at a released model's sizes with nothing downloaded. The
    text means nothing; use synthetic acceptance (rejection_sample_method 'synthetic') for speculation."""
    tokenizer = shaped_tokenizer(name)
    target_config, draft_config = benchmarking.SHAPES[name]
    weightless = sorted(method for method, cls in PROPOSERS.items() if not cls.needs_drafter)
    if method is not None and method not in weightless and method not in DRAFTERS:
        raise ValueError(f"method {method!r} with model {SHAPE_PREFIX}{name}: allowed {sorted(DRAFTERS) + weightless}")
    drafter = None if method is None or method in weightless else build_drafter(method, target_config, draft_config)
    return build_target(target_config), tokenizer, drafter


def shaped_tokenizer(name: str):
    """shape:NAME's word-level tokenizer (shaped_models): id i is the word '<i>'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if name not in benchmarking.SHAPES:
        raise ValueError(f"model {SHAPE_PREFIX}{name}: allowed shapes {sorted(benchmarking.SHAPES)}")
    words = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(benchmarking.SHAPES[name][0].vocab_size)},
                                       unk_token="<0>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words)


def spec_method(drafter: str) -> str:
    """The SpecConfig method of a drafter in DRAFTERS (NAME_fr: over a draft vocabulary)."""
    return drafter.removesuffix(FR_SUFFIX)


def build_target(config: ModelConfig, model_shards: int = 1):
    """A random target of these shapes on the device, in the decoding layout (as for_decoding gives
    large models on a GPU) for model_shards on the mesh's model axis."""
    return to_decoding_layout(benchmarking.on_device(lambda: init_model(config, seed=0)), model_shards)


def build_drafter(drafter: str, target_config: ModelConfig, draft_config: ModelConfig, model_shards: int = 1):
    """A random drafter in DRAFTERS for the target, on the device in the decoding layout, as its proposer's
    `shaped` builds it; NAME_fr: the same drafter over the first SHAPED_DRAFT_VOCAB ids (FR-Spec: a draft step
    reads those rows of the target's LM head; speed does not depend on which ids)."""
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter {drafter!r} is unknown: allowed {', '.join(DRAFTERS)}")
    proposer = proposer_class(spec_method(drafter))
    weights = proposer.shaped(target_config, draft_config, model_shards)
    if drafter.endswith(FR_SUFFIX):
        weights = proposer.with_draft_vocabulary(weights, np.arange(min(SHAPED_DRAFT_VOCAB, target_config.vocab_size)))
    return weights


def cache_size_for(prompt_len: int, new_tokens: int, num_draft: int) -> int:
    """Cache slots for a prompt, its new tokens and a last verification block, in multiples of 128."""
    return -(-(prompt_len + new_tokens + num_draft + 1) // 128) * 128


def generation_args(model, batch: int, prompt_len: int, new_tokens: int, lookahead: int, cache_size: int):
    """decode_loop's array arguments for `batch` random prompts of prompt_len tokens (seeded by the shape), each row
    its own seed: synthetic acceptance draws from it, and rows of one seed would accept alike at every step."""
    rng = np.random.default_rng(batch * 7919 + prompt_len)
    prompts = rng.integers(0, model.config.vocab_size, (batch, prompt_len)).tolist()
    return loop_arrays(pad_request(model, prompts, new_tokens, np.arange(batch), cache_size, lookahead))[0]


def synthetic_spec(drafter: str, tau: float, num_draft: int, total_tokens: int | None = None,
                   tree_top_k: int | None = None, rates: tuple[float, ...] | None = None,
                   adaptive: bool = False) -> SpecConfig:
    """K = num_draft drafts a step (or a dynamic tree of depth K: total_tokens, tree_top_k), of which the
    verifier accepts a mean of tau (synthetic acceptance; along a tree's first-ranked path), or with
    rates, position i with the unconditional rate rates[i] (the first K of them: a per-position profile);
    adaptive: with enable_adaptive_verification."""
    acceptance = (dict(synthetic_acceptance_length=tau) if rates is None
                  else dict(synthetic_acceptance_rates=tuple(rates[:num_draft])))
    return SpecConfig(method=spec_method(drafter), num_speculative_tokens=num_draft, total_tokens=total_tokens,
                      tree_top_k=tree_top_k, rejection_sample_method="synthetic", enable_adaptive_verification=adaptive,
                      **acceptance)


def autoregressive_run(target, cache_size: int):
    """run(args) -> the final DecodeState of greedy autoregressive decoding of generation_args."""
    return lambda args: decode_loop(target, *args, mode=SamplingMode(), eos_token_ids=(), cache_size=cache_size)


def speculative_run(target, weights, spec: SpecConfig, cache_size: int, final_state: bool = False,
                    verify_costs=None, widest_runs: bool = False):
    """run(args) -> the final DecodeState of greedy speculative decoding with the drafter's weights (with
    final_state, the loop's whole SpecState: its acceptance counters too); verify_costs: with adaptive
    verification, specjax.adaptive.verify_costs of the batch's cost curve; widest_runs as speculative_loop's."""
    proposer = build_proposer(spec, GREEDY, cache_size, weights)
    bound = proposer.bind(weights, target)

    def run(args):
        return speculative_loop(target, bound, *args, verify_costs=verify_costs, proposer=proposer, eos_token_ids=(),
                                widest_runs=widest_runs)

    return run if final_state else lambda args: run(args).decode


def tokens_per_s(run, run_args, one_args) -> tuple[float, float]:
    """(tokens a second past each row's first, seconds of the one-token run): the full run's time
    minus that of a run of one new token a row (the same program: prefill and dispatch cancel)."""
    t_one, t_full = benchmarking.timed(lambda: run(one_args)), benchmarking.timed(lambda: run(run_args))
    generated = float(jnp.sum(run(run_args).num_generated))
    return (generated - run_args[0].shape[0]) / (t_full - t_one), t_one


def floor_tokens_per_s(target, batch: int, context: float, bandwidth: float, model_shards: int = 1) -> float:
    """Autoregressive tokens/s at the HBM floor: a step reads the target's weights and the KV cache at
    `context` tokens a row (each device its 1 / model_shards) at `bandwidth` bytes/s."""
    config = target.config
    step_bytes = (benchmarking.weight_bytes(target, config, batch) + benchmarking.kv_bytes(config, batch, context))
    return batch * bandwidth * model_shards / step_bytes


COLUMNS = [("B", "batch"), ("ar_tok_s", "AR tok/s"), ("floor_tok_s", "HBM floor tok/s"),
           ("ar_of_floor", "AR / floor"), ("spec_tok_s", "speculative tok/s"), ("speedup", "speedup")]


def speed_table(shape: str = "8b", batches=(1,), prompt_len: int = 128, new_tokens: int = 128, tau: float = 4.0,
                num_draft: int = 5, drafter: str = "eagle") -> tuple[list[dict], dict]:
    """(rows, meta): autoregressive and speculative tokens/s and the HBM floor at each batch size."""
    target_config, draft_config = benchmarking.SHAPES[shape]
    target = build_target(target_config)
    weights = build_drafter(drafter, target_config, draft_config)
    cache_size = cache_size_for(prompt_len, new_tokens, num_draft)
    autoregressive = autoregressive_run(target, cache_size)
    speculative = speculative_run(target, weights, synthetic_spec(drafter, tau, num_draft), cache_size)
    copy_bytes = (2 << 30) if shape == "8b" else (16 << 20)  # several times the L2 of a GPU; tiny: quick
    bandwidths = [benchmarking.copy_bandwidth(copy_bytes)]
    rows = []
    for batch in batches:
        run_args, one_args = (generation_args(target, batch, prompt_len, n, num_draft + 1, cache_size)
                              for n in (new_tokens, 1))
        ar_tok_s, _ = tokens_per_s(autoregressive, run_args, one_args)
        spec_tok_s, _ = tokens_per_s(speculative, run_args, one_args)
        rows.append({"B": batch, "prompt": prompt_len, "new": new_tokens, "ar_tok_s": ar_tok_s,
                     "spec_tok_s": spec_tok_s, "speedup": spec_tok_s / ar_tok_s})
    bandwidths.append(benchmarking.copy_bandwidth(copy_bytes))
    for row in rows:  # against the higher of the bandwidths measured before and after: the lower floor
        row["floor_tok_s"] = floor_tokens_per_s(target, row["B"], prompt_len + new_tokens / 2, max(bandwidths))
        row["ar_of_floor"] = row["ar_tok_s"] / row["floor_tok_s"]
    meta = {**benchmarking.environment(), "shape": shape, "weights": "random bfloat16",
            "acceptance": f"synthetic, mean {tau:g} of K = {num_draft}", "drafter": drafter,
            "prompt": prompt_len, "new_tokens": new_tokens, "copy_bandwidth_TBps": round(max(bandwidths) / 1e12, 3)}
    return rows, meta


def markdown(rows: list[dict], meta: dict) -> str:
    """The table with a heading that says what it is: random weights, synthetic acceptance."""
    target = benchmarking.SHAPES[meta["shape"]][0]
    lines = [f"{meta['shape']}-shaped decoding speed: RANDOM weights, SYNTHETIC acceptance (speed only, no text)",
             f"- target: {target.num_layers} layers, hidden {target.hidden_size}, vocabulary {target.vocab_size}"
             f"{' (Llama-3.1-8B)' if meta['shape'] == '8b' else ''}, {meta['weights']} weights; drafter: "
             f"{DRAFTERS[meta['drafter']]}, "
             f"{meta['acceptance']} drafts accepted a step",
             f"- greedy, prompt {meta['prompt']}, {meta['new_tokens']} new tokens; {meta['device']}, JAX "
             f"{meta['jax']}; HBM floor: the bytes an autoregressive step reads over the copy bandwidth "
             f"measured here ({meta['copy_bandwidth_TBps']} TB/s)", "",
             "| " + " | ".join(header for _, header in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[key]:.2f}" if key in ("ar_of_floor", "speedup") else
                                       f"{row[key]:.0f}" for key, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def skip_reason(shape: str) -> str | None:
    """Why the table is not run here (None: it is)."""
    if shape != "tiny" and jax.default_backend() != "gpu":
        return (f"{shape}-shaped speed table skipped: it needs a GPU (backend here: {jax.default_backend()}); "
                "`specjax speed` on a GPU shows where speculation pays")
    return None


def write(rows: list[dict], meta: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """out_dir/speed_<shape>.json and .md."""
    return benchmarking.write_results(f"speed_{meta['shape']}", rows, [("prompt", "prompt"), ("new", "new"),
                                                                         *COLUMNS], meta, out_dir)

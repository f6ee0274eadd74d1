"""Generate the Hugging Face test fixtures in ``tests/fixtures``.

For every entry of ``FIXTURES`` this builds a tiny randomly initialised causal LM
with PyTorch ``transformers`` (float32, eager attention, 2 layers, vocab 128) and
writes

* ``hf/NAME/``        -- ``save_pretrained`` output (config.json + safetensors),
* ``golden/NAME.npz`` -- reference outputs computed with transformers:
  ``input_ids`` [2, 12] int32, ``logits`` [2, 12, V] float32,
  ``hidden_states`` [L+1, 2, 12, D] float32 (transformers' convention: entry 0 is
  the embedding output, the last entry has the final norm applied),
  ``prompt_{0,1,2}`` / ``greedy_{0,1,2}`` int32 (three batch-1 prompts of lengths
  3, 7, 12 and exactly 12 greedily generated tokens each), ``seed`` and
  ``min_greedy_margin`` (smallest top-1 minus top-2 logit gap over all greedy
  steps; seeds are tried in order until it is >= ``MIN_MARGIN``).

``llama_sharded`` holds the weights of ``llama_gqa`` saved as several shards with
``model.safetensors.index.json``; its golden file is a copy of ``llama_gqa``'s.

Needs torch, transformers, safetensors and numpy; torch is not part of the
default specjax install, so run this from a separate virtual environment:

    python scripts/make_hf_fixtures.py [--out tests/fixtures] [--only NAME ...]
"""

import argparse
import copy
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parent.parent

VOCAB = 128
SEQ_LEN = 12
PROMPT_LENGTHS = (3, 7, 12)
NEW_TOKENS = 12
MIN_MARGIN = 1e-3
MAX_SEED_TRIES = 100
SHARD_SIZE = "100KB"

_LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (model class, config class, config kwargs, first seed to try)
FIXTURES = {
    "llama_gqa": (transformers.LlamaForCausalLM, transformers.LlamaConfig, _LLAMA, 0),
    "llama_mha_tied": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig,
        {**_LLAMA, "num_key_value_heads": 4, "tie_word_embeddings": True},
        100,
    ),
    "llama3_rope": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig,
        {
            **_LLAMA,
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
        200,
    ),
    "llama_head_dim_mqa": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig,
        {**_LLAMA, "head_dim": 24, "num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True},
        300,
    ),
    "qwen2": (
        transformers.Qwen2ForCausalLM,
        transformers.Qwen2Config,
        {**_LLAMA, "use_sliding_window": False},
        400,
    ),
    "qwen3": (
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config,
        {**_LLAMA, "head_dim": 24, "use_sliding_window": False},
        700,
    ),
    "mistral": (
        transformers.MistralForCausalLM,
        transformers.MistralConfig,
        {**_LLAMA, "sliding_window": 5},
        500,
    ),
    "gpt2": (
        transformers.GPT2LMHeadModel,
        transformers.GPT2Config,
        dict(
            vocab_size=VOCAB,
            n_embd=64,
            n_head=4,
            n_layer=2,
            n_positions=64,
            activation_function="gelu_new",
            tie_word_embeddings=True,
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=2,
        ),
        600,
    ),
}
SHARDED = ("llama_sharded", "llama_gqa")  # (fixture name, fixture whose weights it re-saves)


def build_model(model_cls, config_cls, config_kwargs, seed):
    """Random float32 eager-attention model; norm weights and biases are randomised too."""
    torch.manual_seed(seed)
    config = config_cls(**config_kwargs, dtype="float32", attn_implementation="eager")
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif param.ndim == 1:  # RMSNorm / LayerNorm scale
                param.normal_(1.0, 0.1)
    return model


def check_rope_scaling(model):
    """Print how llama3 scaling changes each inverse frequency; require all three regimes."""
    params = model.config.rope_parameters
    dim = model.config.head_dim
    base = 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    scaled = model.model.rotary_emb.inv_freq
    old_len = params["original_max_position_embeddings"]
    regimes = []
    for unscaled, new in zip(base.tolist(), scaled.tolist()):
        wavelen = 2 * math.pi / unscaled
        if wavelen < old_len / params["high_freq_factor"]:
            regime = "high (kept)"
            assert new == unscaled
        elif wavelen > old_len / params["low_freq_factor"]:
            regime = "low (/factor)"
            assert math.isclose(new, unscaled / params["factor"], rel_tol=1e-6)
        else:
            regime = "medium (smoothed)"
            assert unscaled / params["factor"] < new < unscaled
        regimes.append(regime)
        print(f"    wavelen {wavelen:9.2f}  inv_freq {unscaled:.6e} -> {new:.6e}  {regime}")
    assert len(set(regimes)) == 3, "llama3 rope fixture must cover all three regimes"


def check_sliding_window(model, input_ids):
    """The sliding window must change logits exactly at positions that can see past it."""
    window = model.config.sliding_window
    config = copy.deepcopy(model.config)
    config.sliding_window = None
    full = type(model)(config).eval()
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        diff = (model(input_ids).logits - full(input_ids).logits).abs().amax(dim=(0, 2))
    print(f"    max |logits(window={window}) - logits(no window)| per position: {np.round(diff.numpy(), 4)}")
    assert torch.all(diff[:window] == 0) and torch.all(diff[window:] > 1e-3)


def greedy(model, prompt):
    """Exactly NEW_TOKENS greedy tokens (eos disabled) and the min top-1/top-2 logit gap.

    generate() fills unset fields of the config it is given from model.generation_config
    (including eos_token_id), so that is swapped for an empty one while generating.
    """
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    saved, model.generation_config = model.generation_config, transformers.GenerationConfig()
    try:
        with torch.no_grad():
            out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), generation_config=config)
    finally:
        model.generation_config = saved
    out = out[0]
    with torch.no_grad():
        logits = model(out[None]).logits[0, len(prompt) - 1 : -1]
    new = out[len(prompt) :]
    assert len(new) == NEW_TOKENS
    assert torch.equal(logits.argmax(-1), new), "cached generate disagrees with full-forward argmax"
    top2 = logits.topk(2, dim=-1).values
    return new, (top2[:, 0] - top2[:, 1]).min().item()


def record(model, seed):
    """Golden outputs for one model; inputs are drawn from a generator seeded with `seed`."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=gen)
    with torch.no_grad():
        out = model(input_ids, attention_mask=torch.ones_like(input_ids), output_hidden_states=True)
    golden = {
        "input_ids": input_ids.int().numpy(),
        "logits": out.logits.numpy(),
        "hidden_states": torch.stack(out.hidden_states).numpy(),
        "seed": np.int64(seed),
    }
    margins = []
    for i, length in enumerate(PROMPT_LENGTHS):
        prompt = torch.randint(0, VOCAB, (length,), generator=gen)
        new, margin = greedy(model, prompt)
        golden[f"prompt_{i}"], golden[f"greedy_{i}"] = prompt.int().numpy(), new.int().numpy()
        margins.append(margin)
    golden["min_greedy_margin"] = np.float32(min(margins))
    assert all(np.isfinite(v).all() for v in golden.values())
    return golden


def save(name, model, golden, out, **save_kwargs):
    """Write hf/NAME and golden/NAME.npz, then check the checkpoint reloads to the same logits."""
    hf_dir = out / "hf" / name
    shutil.rmtree(hf_dir, ignore_errors=True)
    model.save_pretrained(hf_dir, **save_kwargs)
    (out / "golden").mkdir(parents=True, exist_ok=True)
    np.savez(out / "golden" / f"{name}.npz", **golden)
    verify(type(model), hf_dir, golden)


def verify(model_cls, hf_dir, golden):
    """Reloading the checkpoint with from_pretrained must reproduce the golden logits exactly."""
    model = model_cls.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(golden["input_ids"]).long()).logits.numpy()
    assert np.array_equal(logits, golden["logits"]), f"{hf_dir}: reloaded logits differ"


def make_fixture(name, spec, out):
    """Build (trying seeds in order), save and record one fixture; returns the model and golden dict."""
    model_cls, config_cls, config_kwargs, first_seed = spec
    for seed in range(first_seed, first_seed + MAX_SEED_TRIES):
        model = build_model(model_cls, config_cls, config_kwargs, seed)
        golden = record(model, seed)
        if golden["min_greedy_margin"] >= MIN_MARGIN:
            break
        print(f"  {name}: seed {seed} rejected (min greedy margin {golden['min_greedy_margin']:.2e})")
    else:
        raise RuntimeError(f"{name}: no seed in {MAX_SEED_TRIES} tries reaches margin {MIN_MARGIN}")
    logits = golden["logits"]
    print(f"  {name}: seed {seed}, min greedy margin {golden['min_greedy_margin']:.4f}, "
          f"logit std {logits.std():.3f}, mean max softmax prob "
          f"{torch.softmax(torch.from_numpy(logits), -1).amax(-1).mean():.3f}")
    if (getattr(model.config, "rope_parameters", None) or {}).get("rope_type") == "llama3":
        check_rope_scaling(model)
    if getattr(model.config, "sliding_window", None) is not None:
        check_sliding_window(model, torch.from_numpy(golden["input_ids"]).long())
    save(name, model, golden, out)
    return model, golden


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures")
    parser.add_argument("--only", nargs="+", choices=sorted(FIXTURES), help="make only these fixtures")
    args = parser.parse_args()
    out = args.out
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__} -> {out}")
    models = {name: make_fixture(name, spec, out) for name, spec in FIXTURES.items()
              if args.only is None or name in args.only}
    sharded, source = SHARDED
    if source not in models:
        return
    model, golden = models[source]
    save(sharded, model, golden, out, max_shard_size=SHARD_SIZE)
    assert (out / "hf" / sharded / "model.safetensors.index.json").exists()
    print(f"  {sharded}: {source} weights in {len(list((out / 'hf' / sharded).glob('*.safetensors')))} shards")


if __name__ == "__main__":
    main()

"""generate(): one compiled program, exact sampling distribution, per-row seeds, budgets and EOS,
and clear errors for requests that cannot run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import fixture_dir, golden
from support.distributions import chi_square_pvalue
from support.jaxpr import primitives

from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding import batch_bucket, decode_loop, generate, loop_arrays, pad_request
from specjax.models import hf
from specjax.models.transformer import init_model

TINY = ModelConfig(vocab_size=8, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                   intermediate_size=32, max_position_embeddings=64, init_std=0.6)
PROMPT = [1, 5, 2]


def exact_first_two_tokens(model, sampling: SamplingConfig) -> np.ndarray:
    """P(t1, t2 | PROMPT) enumerated from full forwards of the model, processed like the sampler."""
    from specjax.verify.sampling import processed_probs

    vocab = model.config.vocab_size
    contexts = jnp.asarray([PROMPT + [t] for t in range(vocab)])
    positions = jnp.broadcast_to(jnp.arange(contexts.shape[1]), contexts.shape)
    logits, _, _ = model(contexts, positions)
    p1 = np.asarray(processed_probs(logits[0, len(PROMPT) - 1], sampling), np.float64)
    p2 = np.asarray(processed_probs(logits[:, len(PROMPT)], sampling), np.float64)
    return p1[:, None] * p2  # [t1, t2]


@pytest.mark.loop
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0),
                                      SamplingConfig(temperature=0.7, top_p=0.9),
                                      SamplingConfig(temperature=1.2, top_k=4)], ids=str)
def test_generated_tokens_follow_the_model_distribution(sampling):
    model = init_model(TINY, seed=1)
    num_rows = 32768
    result = generate(model, [PROMPT] * num_rows, max_new_tokens=2, sampling=sampling, seeds=range(num_rows))
    pairs = result.tokens[:, 0] * TINY.vocab_size + result.tokens[:, 1]
    counts = np.bincount(pairs, minlength=TINY.vocab_size ** 2)
    assert chi_square_pvalue(counts, exact_first_two_tokens(model, sampling)) > 1e-3
    # Negative control: the same counts against the unprocessed (temperature 1) distribution fail.
    if sampling != SamplingConfig(temperature=1.0):
        wrong = exact_first_two_tokens(model, SamplingConfig(temperature=1.0))
        assert chi_square_pvalue(counts, wrong) < 1e-6


@pytest.mark.loop
def test_a_row_depends_on_its_seed_and_prompt_only():
    model = init_model(TINY, seed=1)
    sampling = SamplingConfig(temperature=1.0)
    alone = generate(model, [PROMPT], max_new_tokens=20, sampling=sampling, seeds=7).sequences()[0]
    batched = generate(model, [[4, 4], PROMPT, [3] * 9], max_new_tokens=[5, 20, 11], sampling=sampling,
                       seeds=[1, 7, 2]).sequences()
    assert batched[1] == alone
    again = generate(model, [PROMPT], max_new_tokens=20, sampling=sampling, seeds=7).sequences()[0]
    other = generate(model, [PROMPT], max_new_tokens=20, sampling=sampling, seeds=8).sequences()[0]
    assert again == alone and other != alone


@pytest.mark.loop
def test_rows_stop_at_their_own_budget_and_eos():
    model = hf.load(fixture_dir("llama_gqa"))
    ref = golden("llama_gqa")
    greedy = [ref[f"greedy_{i}"].tolist() for i in range(3)]
    eos = greedy[0][4]
    first_eos = [seq.index(eos) if eos in seq else None for seq in greedy]
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
    result = generate(model, prompts, max_new_tokens=[12, 3, 0], eos_token_ids=[eos])
    assert result.sequences()[0] == greedy[0][:first_eos[0] + 1]  # EOS kept, nothing after it
    assert result.stopped_by_eos[0]
    expected_1 = greedy[1][:3] if first_eos[1] is None or first_eos[1] >= 3 else greedy[1][:first_eos[1] + 1]
    assert result.sequences()[1] == expected_1
    assert result.sequences()[2] == [] and result.num_generated[2] == 0
    assert result.tokens.shape == (3, 12) and not result.tokens[0, first_eos[0] + 1:].any()


def _loop_args(model, prompts, max_new_tokens):
    request = pad_request(model, prompts, max_new_tokens)
    arrays, mode = loop_arrays(request, SamplingConfig(temperature=0.9, top_k=5))
    return (model, *arrays), dict(mode=mode, eos_token_ids=(2,), cache_size=request.cache_size)


@pytest.mark.loop
def test_generation_is_one_program_with_one_while_loop_and_no_host_callback():
    model = hf.load(fixture_dir("llama_gqa"))
    args, static = _loop_args(model, [[1, 2, 3], [4] * 9], 10)
    jaxpr = jax.make_jaxpr(functools.partial(decode_loop, **static))(*args)
    prims = primitives(jaxpr.jaxpr)
    (outer_jit,) = [name for name, depth in prims if depth == 0]  # everything inside one jitted call
    assert outer_jit in ("pjit", "jit")
    loops = [name for name, depth in prims if name == "while" and depth == 1]
    assert loops == ["while"], "the decode steps must run as one while loop"
    assert {name for name, _ in prims if name == "scan"}, "layers run as a scan"
    assert not [name for name, _ in prims if "callback" in name or "feed" in name]
    hlo = decode_loop.lower(*args, **static).as_text()
    assert "callback" not in hlo and "outfeed" not in hlo and "infeed" not in hlo


@pytest.mark.loop
def test_a_new_prompt_length_in_the_same_bucket_does_not_recompile():
    model = hf.load(fixture_dir("llama_gqa"))
    generate(model, [[1, 2, 3]], max_new_tokens=8)
    compiled = decode_loop._cache_size()
    generate(model, [[5, 6, 7, 8, 9, 10, 11]], max_new_tokens=8)  # 7 tokens: still the 16 bucket
    generate(model, [[5, 6], [9] * 13], max_new_tokens=5)  # batch 2: a new batch bucket
    assert decode_loop._cache_size() == compiled + 1


@pytest.mark.loop
def test_bucket_padding_does_not_change_greedy_outputs():
    model = hf.load(fixture_dir("qwen2"))
    prompt = golden("qwen2")["prompt_1"].tolist()
    alone = generate(model, [prompt], max_new_tokens=12).sequences()[0]
    padded = generate(model, [prompt] + [[1]] * 4, max_new_tokens=12, cache_size=256).sequences()[0]
    assert alone == padded == golden("qwen2")["greedy_1"].tolist()


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[[1] * 60], max_new_tokens=10, cache_size=64),
     r"row 0: prompt \(60 tokens\) \+ max_new_tokens \(10\) = 70 does not fit cache_size 64"),
    (dict(prompts=[[1, 2], [3, 400]], max_new_tokens=4), r"prompt 1 has token id 400: allowed 0..127"),
    (dict(prompts=[[1, 2]], max_new_tokens=-1), r"max_new_tokens for row 0 is -1: allowed >= 0"),
    (dict(prompts=[[1], []], max_new_tokens=3), r"prompt 1 is empty"),
    (dict(prompts=[], max_new_tokens=3), r"prompts is empty"),
])
def test_bad_requests_are_refused_with_the_reason(kwargs, message):
    model = hf.load(fixture_dir("llama_gqa"))
    with pytest.raises(ValueError, match=message):
        generate(model, **kwargs)


@pytest.mark.loop
def test_positions_bound_the_request():
    """Learned positions and RoPE alike: prompt + max_new_tokens past max_position_embeddings is refused, naming
    both numbers (issue 35: a 6,952-token prompt on a 2,048-position target ran silently)."""
    model = hf.load(fixture_dir("gpt2"))  # n_positions 64
    with pytest.raises(ValueError, match=r"= 70 exceeds max_position_embeddings \(64\) of this model's learned"):
        generate(model, [[1] * 50], max_new_tokens=20)
    model = hf.load(fixture_dir("llama_gqa"))  # RoPE, 128 positions
    with pytest.raises(ValueError, match=r"row 1: prompt \(120 tokens\) \+ max_new_tokens \(9\) = 129 exceeds "
                                         r"max_position_embeddings \(128\) of this model's positions \(RoPE\): "
                                         r"allowed at most 128 in all"):
        generate(model, [[1] * 3, [1] * 120], max_new_tokens=9)
    assert len(generate(model, [[1] * 120], max_new_tokens=8).sequences()[0]) == 8  # 128 fits




@pytest.mark.loop
def test_cache_dtype_is_separate_from_the_model_and_checked():
    from specjax.config import ConfigError
    from specjax.models.kv_cache import KVCache

    model = hf.load(fixture_dir("llama_gqa"))
    tokens = jnp.asarray([golden("llama_gqa")["prompt_2"]])
    positions = jnp.arange(tokens.shape[1])[None]
    full, _, _ = model(tokens, positions)
    cache = KVCache.create(model.config, 1, 16, jnp.bfloat16)
    logits, _, cache = model(tokens, positions, cache)
    assert cache.k.dtype == jnp.bfloat16 and model.embed[...].dtype == jnp.float32
    assert 0 < np.abs(np.asarray(logits - full)).max() < 0.05 * np.abs(np.asarray(full)).max()
    assert generate(model, [[1, 2]], max_new_tokens=4, cache_dtype="bfloat16").num_generated[0] == 4
    with pytest.raises(ConfigError, match=r"cache_dtype = 'int8' is invalid: allowed \["):
        generate(model, [[1, 2]], max_new_tokens=2, cache_dtype="int8")


def test_a_large_batch_is_padded_by_less_than_an_eighth_and_a_small_one_to_a_power_of_two():
    """generate's batch padding (decoding.batch_bucket): powers of two up to 4,096 rows (few programs for small
    batches), then a multiple of a sixteenth of the next power of two, so 65,600 rows compute 73,728, not 131,072."""
    assert [batch_bucket(n) for n in (1, 3, 5, 4096)] == [1, 4, 8, 4096]
    assert batch_bucket(65_600) == 73_728
    for n in range(4097, 300_000, 997):
        padded = batch_bucket(n)
        assert n <= padded < n * 9 / 8, n
        assert padded % (1 << (n - 1).bit_length() - 4) == 0, n  # a sixteenth of the next power of two

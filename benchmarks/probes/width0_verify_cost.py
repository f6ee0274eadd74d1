"""What a synthetic T 0 step's verify computes at batch 256 and vocabulary 128,256 (bf16 logits), on the backend
at hand: K 15 through verify_drafts (synthetic, and the real greedy rule) and width 0 (the former path, a verifier
over two padded positions; decode_step's sample), at T 0 and T 1 (docs/performance.md, twenty-seventh session).

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/probes/width0_verify_cost.py   # before: run it at 2487a32
"""
import time

import jax
import jax.numpy as jnp

from specjax.verify import verify_drafts, lossless_verifiers
from specjax.verify.sampling import GREEDY, SamplingMode, SamplingParams, sample
from specjax.config import SamplingConfig, SpecConfig
from specjax import adaptive

B, V, K = 256, 128256, 15
rates = SpecConfig(num_speculative_tokens=K, rejection_sample_method="synthetic",
                   synthetic_acceptance_length=3.65).synthetic_rates
params = SamplingParams.of([], B)
keys = jax.random.split(jax.random.key(0), B)
verifiers = lossless_verifiers(SpecConfig())

def timed(name, fn, *args):
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(5):
        t = time.perf_counter(); jax.block_until_ready(fn(*args)); times.append(time.perf_counter() - t)
    print(f"{name}: {1e3 * min(times):.1f} ms", flush=True)

logits16 = jax.random.normal(jax.random.key(1), (B, K + 1, V), jnp.bfloat16)
drafts = jnp.zeros((B, K), jnp.int32)
timed("K15 synthetic T0 verify", lambda lg, d: verify_drafts(lg, d, None, keys, None, sampling=params, mode=GREEDY,
      verifiers=verifiers, method=jnp.int32(0), synthetic_rates=rates), logits16, drafts)
timed("K15 greedy verify", lambda lg, d: verify_drafts(lg, d, None, keys, None, sampling=params, mode=GREEDY,
      verifiers=verifiers, method=jnp.int32(0)), logits16, drafts)
logits1 = logits16[:, :1]
zero = jnp.zeros((B,), jnp.int32)
timed("width 0, synthetic verifier over 2 padded positions", lambda lg, d: verify_drafts(
      adaptive.padded(lg, 2), d[:, :1], None, keys, None, sampling=params, mode=GREEDY, verifiers=verifiers,
      method=jnp.int32(0), synthetic_rates=rates[:1], num_valid=zero), logits1, drafts)
timed("width 0, sample (decode_step's)", lambda lg: sample(lg[:, 0], keys, params, GREEDY), logits1)
hot = SamplingParams.of([SamplingConfig(temperature=1.0)] * B)
mode = SamplingMode(sampled=True)
timed("width 0, T 1: lossless verifiers over 2 padded positions", lambda lg, d: verify_drafts(
      adaptive.padded(lg, 2), d[:, :1], jnp.zeros((B, 1, V)), keys, None, sampling=hot, mode=mode, verifiers=verifiers,
      method=jnp.int32(0), num_valid=zero), logits1, drafts)
timed("width 0, T 1: sample (decode_step's)", lambda lg: sample(lg[:, 0], keys, hot, mode), logits1)

"""Shared test helpers: fixtures, the exact-distribution machinery of the losslessness tests, the
models and requests that several test files decode with, and the drafters of tests/test_lossless.py.
Tests run on the CPU in float32 so that parity tolerances mean something."""

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# On GPUs XLA accumulates scatter-adds (embedding gradients) with atomics, so two runs of one training
# program differ in the last bits (on the H200 from the 6th step of tests/test_training.py's run), and
# the training tests compare runs exactly: the suite asks for XLA's deterministic ops, a GPU option
# (the CPU is deterministic anyway). The CLI runs those tests start inherit it.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
# On the CPU the suite compiles hundreds of small programs, and compiling dominates its time: XLA's CPU
# backend at optimization level 0 (LLVM's; the HLO passes run as always) compiles them about twice as
# fast. XLA_FLAGS naming a level keep it (docs/testing.md).
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import dataclasses  # noqa: E402
import functools  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

# Eight host devices, for the meshes of tests/test_sharding.py; everything else runs on device 0.
jax.config.update("jax_num_cpu_devices", 8)
# Many programs are compiled by several tests, by both pytest-xdist workers, and again after
# release_compiled_programs (below) clears the in-memory caches: JAX's persistent compilation cache
# keeps those that took 1 s or more to compile on disk (writing every small program cost more than it
# saved on a fresh clone; docs/testing.md). Keyed by the program, the backend and the flags, so a stale
# entry is never used; kept to 2 GB, least recently used first.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", str(Path(__file__).parent.parent / ".pytest_cache" / "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
jax.config.update("jax_compilation_cache_max_size", 2 << 30)
# Float32 products in float32 where the suite is run on a GPU too (JAX_PLATFORMS=cuda), whose default
# is TF32 (the CPU's is float32 already): the float32 tolerances assume it.
jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from specjax.config import ModelConfig, SamplingConfig, SpecConfig  # noqa: E402
from specjax.decoding import generate, loop_arrays, pad_request, static_spec  # noqa: E402
from specjax.models import hf  # noqa: E402
from specjax.models.dflash import DFlashConfig, DFlashDrafter, init_dflash  # noqa: E402
from specjax.models.eagle import EagleConfig, init_eagle, with_draft_vocabulary  # noqa: E402
from specjax.models.medusa import MedusaConfig, init_medusa  # noqa: E402
from specjax.models.transformer import init_model  # noqa: E402
from specjax.proposers import build_proposer  # noqa: E402
from specjax.verify import lossless_verifiers, method_index  # noqa: E402
from specjax.verify.sampling import processed_probs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
HF_FIXTURES = sorted(p.name for p in (FIXTURES / "hf").iterdir() if p.is_dir())


def fixture_dir(name: str) -> Path:
    return FIXTURES / "hf" / name


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "golden" / f"{name}.npz") as data:
        return dict(data)


@functools.partial(jax.jit, static_argnames=("hidden_layers", "compute_logits", "causal"))
def forward(model, tokens, positions, cache=None, *, hidden_layers=(), compute_logits=True, causal=True,
            attention_mask=None):
    """model(tokens, positions, cache, ...) as one program: called eagerly, a model compiles one program per
    operation and shape, which made the model-level tests' time mostly compiling (docs/testing.md)."""
    return model(tokens, positions, cache, hidden_layers=hidden_layers, compute_logits=compute_logits,
                 causal=causal, attention_mask=attention_mask)


def positions_like(tokens) -> jnp.ndarray:
    """Positions 0..T-1 for every row of a [B, T] token array."""
    batch, length = tokens.shape
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


# One process running the whole suite (pytest without -n) compiles thousands of programs; JAX's caches
# keep each one, and each XLA:CPU program holds a few memory mappings of its own. Past the kernel's
# vm.max_map_count (65530 by default) the next compile segfaults inside XLA ("LLVM compilation error:
# Cannot allocate memory"), in tests/test_train_eagle.py in a serial run. Clearing the caches after a
# module, once the process holds half that many mappings, keeps it below; one module adds at most a
# few thousand.
MEMORY_MAPS, MAX_MAP_COUNT = Path("/proc/self/maps"), Path("/proc/sys/vm/max_map_count")


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    yield
    if MEMORY_MAPS.exists() and MAX_MAP_COUNT.exists():
        with MEMORY_MAPS.open("rb") as maps:
            count = maps.read().count(b"\n")
        if count > int(MAX_MAP_COUNT.read_text()) // 2:
            jax.clear_caches()
            gc.collect()  # frees the executables held only by reference cycles now


# SPECJAX_COMPILE_REPORT=FILE: each test's compile count and seconds (tracing, lowering, XLA), setup and
# teardown included, appended to FILE as JSON lines by every worker (scripts/compile_report.py sums them).
# Set JAX_COMPILATION_CACHE_DIR to an empty folder for a cold run's figures: cache hits compile nothing.
COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
                  "/jax/core/compile/backend_compile_duration": "compile_s"}
COMPILE_REPORT = os.environ.get("SPECJAX_COMPILE_REPORT")
compile_totals: dict = {}
compile_by_function: dict = {}  # XLA seconds per compiled function's name
compiles_by_function: dict = {}  # XLA compiles per compiled function's name


def record_compile_event(event: str, duration: float, fun_name: str = "?", **_) -> None:
    if event in COMPILE_EVENTS:
        totals = compile_totals.setdefault(COMPILE_EVENTS[event], [0, 0.0])
        totals[0] += 1
        totals[1] += duration
        if COMPILE_EVENTS[event] == "compile_s":
            compile_by_function[fun_name] = round(compile_by_function.get(fun_name, 0.0) + duration, 3)
            compiles_by_function[fun_name] = compiles_by_function.get(fun_name, 0) + 1


if COMPILE_REPORT:
    jax.monitoring.register_event_duration_secs_listener(record_compile_event)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        import json
        import time

        compile_totals.clear()
        compile_by_function.clear()
        compiles_by_function.clear()
        start = time.perf_counter()
        yield
        record = {"test": item.nodeid, "wall_s": round(time.perf_counter() - start, 3),
                  "programs": compile_totals.get("compile_s", [0, 0.0])[0],
                  **{name: round(total, 3) for name, (_, total) in compile_totals.items()},
                  "xla_s_by_function": dict(compile_by_function),
                  "compiles_by_function": dict(compiles_by_function)}
        with open(COMPILE_REPORT, "a") as out:
            out.write(json.dumps(record) + "\n")


@pytest.fixture(scope="session")
def trained_tiny_target(tmp_path_factory) -> Path:
    """configs/train/tiny_lm.yaml trained longer, the target the draft-training tests train for: at its
    40 steps its greedy output is one repeated token (any drafter drafts it perfectly); 800 steps of
    batch 8 (about 10 s) give one with varied output."""
    from specjax.config import TrainConfig, load_yaml
    from specjax.training.lm import train_lm

    output_dir = tmp_path_factory.mktemp("target")
    overrides = ["optimizer.total_steps=800", "data.batch_size=8", "checkpoint_every=800", "log_every=100"]
    train_lm(load_yaml(TrainConfig, REPO / "configs/train/tiny_lm.yaml", [*overrides, f"output_dir={output_dir}"]))
    return output_dir / "model"


def drafter_run_config(config_class, path: Path, target_dir, output_dir, *overrides):
    """A drafter-training config from its YAML, for the target folder and the output folder."""
    from specjax.config import load_yaml

    return load_yaml(config_class, path, [f"target={target_dir}", f"output_dir={output_dir}", *overrides])


def train_through_cli(command: str, config: Path, target_dir, output_dir: Path) -> Path:
    """`specjax COMMAND --config CONFIG` for the target, in a subprocess, as a user would run it."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "specjax.cli", command, "--config", str(config), "--set",
                    f"target={target_dir}", "--set", f"output_dir={output_dir}"],
                   check=True, cwd=REPO, capture_output=True, text=True)
    return output_dir


@pytest.fixture(params=HF_FIXTURES)
def hf_fixture(request) -> str:
    return request.param


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of observed counts to exact probabilities. Outcomes expected fewer
    than min_expected times are pooled into one cell (the test's approximation needs that); any count
    where the probability is zero gives 0 (an impossible outcome was drawn)."""
    from scipy import stats

    counts, probs = np.asarray(counts).ravel(), np.asarray(probs, np.float64).ravel()
    if np.any(counts[probs == 0]):
        return 0.0
    support = probs > 0
    counts, probs = counts[support], probs[support]
    expected = probs / probs.sum() * counts.sum()
    rare = expected < min_expected
    if rare.any():
        counts = np.append(counts[~rare], counts[rare].sum())
        expected = np.append(expected[~rare], expected[rare].sum())
    return float(stats.chisquare(counts, expected).pvalue)


CODE_TEXT = ["def add(a, b):\n    return a + b\n", "for item in items:\n    total += item\n",
             "for i in range(10):\n    print(i)\n"] * 30


def write_tiny_checkpoint(folder: Path, seed: int = 0):
    """A random 2-layer Llama-style checkpoint folder with a BPE tokenizer trained on CODE_TEXT, as
    transformers and `specjax generate` read it; returns the tokenizer."""
    from specjax.config import ModelConfig
    from specjax.data.tokenizer import train_bpe_tokenizer
    from specjax.models import hf
    tokenizer = train_bpe_tokenizer(CODE_TEXT, vocab_size=300)
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, intermediate_size=64, init_std=0.3)
    hf.save(init_model(config, seed=seed), folder, extra_config={"eos_token_id": tokenizer.eos_token_id})
    tokenizer.save_pretrained(folder)
    return tokenizer


@pytest.fixture
def lower_for_cuda(monkeypatch):
    """lower_for_cuda(fn, *abstract_args): the StableHLO text of fn lowered for CUDA, Pallas kernels
    through Triton. Interpret mode runs any primitive; Triton does not (e.g. no `slice`), and lowering
    needs no GPU once it is told which one: an H100's compute capability (a private JAX hook)."""
    import types

    from jax import export
    from jax._src.pallas.triton import pallas_call_registration

    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: types.SimpleNamespace(compute_capability=90))

    def lower(fn, *abstract_args) -> str:
        exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*abstract_args)
        return exported.mlir_module()

    return lower


# ------------------------------------------------------------------------------------- jaxpr walks

def equations(jaxpr, depth=0):
    """(equation, nesting depth) for every equation, descending into sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn, depth
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner, depth + 1)


def primitives(jaxpr) -> list[tuple[str, int]]:
    """(primitive name, nesting depth) for every equation, descending into sub-jaxprs."""
    return [(eqn.primitive.name, depth) for eqn, depth in equations(jaxpr)]


def speculative_loop_args(target, drafter, prompts, max_new_tokens, spec: SpecConfig, sampling: SamplingConfig,
                          eos_token_ids=()):
    """(args, static keyword arguments) of `decoding.speculative_loop` for a request, as generate builds
    them (the proposer built for the drafter, its weights bound to the target)."""
    request = pad_request(target, prompts, max_new_tokens, lookahead=spec.num_draft_nodes + 1)
    arrays, mode = loop_arrays(request, sampling)
    proposer = build_proposer(static_spec(spec, mode), mode, request.cache_size, drafter)
    args = (target, proposer.bind(drafter, target), *arrays, jnp.int32(method_index(spec)))
    return args, dict(proposer=proposer, verifiers=lossless_verifiers(spec), eos_token_ids=tuple(eos_token_ids))


# ------------------------------------------------------------------- the target, drafts and requests

EOS = 7


def perturbed(model, scale: float, seed: int = 0):
    """The model with Gaussian noise on every weight: a draft that agrees with it often, not always."""
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@functools.cache
def target_and_drafts():
    """The llama_gqa fixture and two draft models for it: "perturbed" (close) and "unrelated"."""
    target = hf.load(fixture_dir("llama_gqa"))
    return target, {"perturbed": perturbed(target, 0.01), "unrelated": hf.load(fixture_dir("llama_mha_tied"))}


def dflash_config(target_config: ModelConfig, target_layer_ids: tuple[int, ...], block_size: int,
                  **layer_changes) -> DFlashConfig:
    """A DFlash drafter's shape for a target: one Qwen3 layer as wide as the target's (layer_changes
    change it), the target's last id as mask."""
    layer = dataclasses.replace(target_config, num_layers=1, qk_norm=True, architecture="Qwen3ForCausalLM",
                                **layer_changes)
    return DFlashConfig(layer=layer, target_layer_ids=target_layer_ids, mask_token_id=target_config.vocab_size - 1,
                        block_size=block_size, num_target_layers=target_config.num_layers)


@functools.cache
def trained_dflash() -> DFlashDrafter:
    """A DFlash drafter (block 16, reading both layers) for target_and_drafts()'s target, trained for
    300 steps on the target's greedy continuations of random prompts, distilling its distribution. The
    target is random, so little of that generalises: its drafts are accepted now and then (a mean
    acceptance length of about 1.03 at K 8), enough for greedy tests to verify accepted drafts."""
    import optax
    from flax import nnx

    from specjax.training.dflash import dflash_loss, sample_anchors

    target, _ = target_and_drafts()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, 4).tolist() for _ in range(64)]
    text = np.asarray(generate(target, prompts, max_new_tokens=60).tokens)  # [64, 60]: greedy
    tokens = np.concatenate([np.asarray(prompts), text], axis=1)
    drafter = init_dflash(dflash_config(target.config, (0, 1), block_size=16), seed=0)
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    optimizer = optax.adam(3e-3)

    @jax.jit
    def train_step(params, opt_state, batch, anchors):
        loss = lambda p: dflash_loss(nnx.merge(graphdef, p, rest), target, batch, anchors, 7.0, 1.0)[0]  # noqa: E731
        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = optimizer.init(params)
    for step in range(300):
        rows = rng.choice(len(tokens), 16, replace=False)
        anchors = sample_anchors(rng, 16, tokens.shape[1], 16, 8)
        params, opt_state = train_step(params, opt_state, jnp.asarray(tokens[rows]), jnp.asarray(anchors))
    return nnx.merge(graphdef, params, rest)


@functools.cache
def ragged_requests():
    """56 ragged prompts of 1-20 tokens and budgets of 1-24 tokens (some rows stop at EOS)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, rng.integers(1, 21)).tolist() for _ in range(56)]
    budgets = rng.integers(1, 25, len(prompts)).tolist()
    return prompts, budgets


@functools.cache
def repeating_requests():
    """20 ragged requests, every other prompt a repeated block: n-gram lookup finds drafts in them."""
    rng = np.random.default_rng(0)
    prompts = []
    for row in range(20):
        if row % 2:  # repeats, so that many drafts come from the prompt
            block = rng.integers(0, 128, rng.integers(2, 7)).tolist()
            prompts.append((block * 8)[:rng.integers(len(block) + 1, 21)])
        else:
            prompts.append(rng.integers(0, 128, rng.integers(1, 21)).tolist())
    return prompts, rng.integers(1, 33, len(prompts)).tolist()


REQUESTS = {"ragged": ragged_requests, "ragged16": lambda: tuple(x[:16] for x in ragged_requests()),
            "repeating": repeating_requests}


@functools.cache
def autoregressive_outputs(requests: str = "ragged"):
    """The target's greedy autoregressive output for REQUESTS[requests], stopping at EOS."""
    prompts, budgets = REQUESTS[requests]()
    return generate(target_and_drafts()[0], prompts, max_new_tokens=budgets, eos_token_ids=[EOS])


# ------------------------------------------------------------------------------- exact distribution

TINY = ModelConfig(vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                   intermediate_size=32, init_std=0.6)
PROMPT = [1, 5, 2]
# Rows of the losslessness tests' one batch. On the CPU 32,768 (their run time is most of the suite's);
# on a GPU 131,072: the top-p miscompilation docs/testing.md tells of showed there only from about
# 20,000 rows on. The negative controls fail with p below 1e-30 at either size (docs/testing.md).
NUM_ROWS = 32_768 if jax.default_backend() == "cpu" else 131_072
NUM_TOKENS = 3


@functools.cache
def tiny_pair():
    """A target and a draft model over 8 token ids, whose first three tokens can be enumerated."""
    return init_model(TINY, seed=1), init_model(TINY, seed=2)


def exact_joint(model, sampling: SamplingConfig, prompt: list[int] = PROMPT) -> np.ndarray:
    """P(t1, t2, t3 | prompt) of the target alone, from full forwards over every continuation."""
    vocab = TINY.vocab_size
    contexts = np.array([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
    positions = jnp.broadcast_to(jnp.arange(contexts.shape[1]), contexts.shape)
    logits, _, _ = model(jnp.asarray(contexts), positions)
    probs = np.asarray(processed_probs(logits, sampling), np.float64).reshape(vocab, vocab, len(prompt) + 2, vocab)
    p1 = probs[0, 0, len(prompt) - 1]
    p2 = probs[:, 0, len(prompt)]  # [t1, t2]
    p3 = probs[:, :, len(prompt) + 1]  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def joint_counts_by_sampling(spec: SpecConfig, samplings, drafter, prompt: list[int] = PROMPT, greedy_rows: int = 0):
    """Counts of the first NUM_TOKENS tokens from the tiny target, NUM_ROWS rows for each of `samplings`,
    all in one batch (one program: the settings are data) with `greedy_rows` greedy rows among them.
    Returns ([counts per sampling], metrics of the whole batch, the greedy rows' tokens [greedy_rows, N])."""
    configs = [SamplingConfig()] * greedy_rows + [s for s in samplings for _ in range(NUM_ROWS)]
    result = generate(tiny_pair()[0], [prompt] * len(configs), max_new_tokens=NUM_TOKENS, sampling=configs,
                      seeds=np.arange(len(configs)), cache_size=32, spec=spec, drafter=drafter)
    assert (result.num_generated == NUM_TOKENS).all()
    codes = np.ravel_multi_index(result.tokens[greedy_rows:].T, (TINY.vocab_size,) * NUM_TOKENS)
    counts = [np.bincount(part, minlength=TINY.vocab_size ** NUM_TOKENS) for part in np.split(codes, len(samplings))]
    return counts, result.metrics, result.tokens[:greedy_rows]


def speculative_joint_counts(spec: SpecConfig, sampling: SamplingConfig, drafter, prompt: list[int] = PROMPT):
    """Counts of the first NUM_TOKENS tokens over NUM_ROWS rows (one batch) from the tiny target."""
    counts, metrics, _ = joint_counts_by_sampling(spec, [sampling], drafter, prompt)
    return counts[0], metrics


# ------------------------------------------------------------------------------------------ drafters

def eagle_config(target_config, version, **kwargs):
    layer = dataclasses.replace(target_config, num_layers=1, init_std=0.1)
    if version == 3:
        kwargs.setdefault("fuse_layers", (0, 1, 2))
    return EagleConfig(layer=layer, version=version, **kwargs)


HEADS = {"eagle": dict(version=1), "eagle3": dict(version=3, draft_vocab_size=100)}
# FR-Spec: the "eagle" head drafting from half the target's 128 ids; the target's greedy output has
# tokens outside them too (checked in the greedy test).
FR_IDS = np.arange(0, 128, 2)
METHOD = {"eagle": "eagle", "eagle3": "eagle3", "eagle_fr": "eagle"}  # head name -> SpecConfig.method


@functools.cache
def head_for(name):
    """An EAGLE head for target_and_drafts()'s target: "eagle", "eagle3" or "eagle_fr"."""
    if name == "eagle_fr":
        return with_draft_vocabulary(head_for("eagle"), FR_IDS)
    target, _ = target_and_drafts()
    return init_eagle(eagle_config(target.config, **HEADS[name]), seed=3)


def with_random_blocks(heads, scale: float, seed: int = 0):
    """The heads with Gaussian residual blocks: zero blocks plus the copied LM head make every head
    repeat the target's next token; random ones make the heads disagree."""
    w_key, b_key = jax.random.split(jax.random.key(seed))
    heads.block_w.set_value(scale * jax.random.normal(w_key, heads.block_w.shape))
    heads.block_b.set_value(scale * jax.random.normal(b_key, heads.block_b.shape))
    return heads


def medusa_for(model, num_heads: int, num_layers: int = 1, scale: float = 0.0, shared: bool = False):
    config = MedusaConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=model.config.hidden_size,
                          vocab_size=model.config.vocab_size, shared_lm_head=shared)
    return with_random_blocks(init_medusa(config, model), scale)


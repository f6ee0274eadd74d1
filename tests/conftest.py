"""Shared test helpers. Tests run on the CPU in float32 so that parity tolerances mean something."""

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# On GPUs XLA accumulates scatter-adds (embedding gradients) with atomics, so two runs of one training
# program differ in the last bits (on the H200 from the 6th step of tests/test_training.py's run), and
# the training tests compare runs exactly: the suite asks for XLA's deterministic ops, a GPU option
# (the CPU is deterministic anyway). The CLI runs those tests start inherit it.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()

from pathlib import Path  # noqa: E402

import jax  # noqa: E402

# Eight host devices, for the meshes of tests/test_sharding.py; everything else runs on device 0.
jax.config.update("jax_num_cpu_devices", 8)
# Float32 products in float32 where the suite is run on a GPU too (JAX_PLATFORMS=cuda), whose default
# is TF32 (the CPU's is float32 already): the float32 tolerances assume it.
jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
HF_FIXTURES = sorted(p.name for p in (FIXTURES / "hf").iterdir() if p.is_dir())


def fixture_dir(name: str) -> Path:
    return FIXTURES / "hf" / name


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "golden" / f"{name}.npz") as data:
        return dict(data)


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
    from specjax.models.transformer import init_model

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

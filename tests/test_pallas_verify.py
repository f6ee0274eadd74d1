"""The Pallas block-verification kernel (interpret mode on the CPU) reproduces the jnp reference
exactly from the same draws, over shapes, distribution kinds and tile boundaries; and where it cannot
compile (no GPU lowering), verify_impl 'pallas' runs the jnp reference with one warning."""

import functools
import itertools
import re
import sys
import warnings

import jax
import numpy as np
import pytest

from specjax.config import SamplingConfig, SpecConfig
from specjax.pallas_kernels import block_verify
from specjax.verify import block, block_chain_verifier
from specjax.verify.testing import KINDS, random_verify_inputs

TILE = 256  # small tiles: several per row, the last one partial (V below is not a multiple)
# One program per shape (eagerly, each of its operations compiles apart).
verify_inputs = jax.jit(random_verify_inputs, static_argnums=(0, 1, 2), static_argnames="kind")


# The two largest shapes are interpreted for long: full tier (`slow`; docs/testing.md).
@pytest.mark.parametrize("batch, num_draft, vocab", [(1, 1, 1000), (3, 4, 1000),
                                                     *(pytest.param(*shape, marks=pytest.mark.slow)
                                                       for shape in ((64, 8, 700), (3, 8, 2049)))])
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_equals_the_reference_exactly(batch, num_draft, vocab, kind):
    seed = batch * 1000 + num_draft * 10 + KINDS.index(kind)
    args = verify_inputs(batch, num_draft, vocab, kind=kind, seed=seed)
    got = jax.jit(functools.partial(block_verify.verify_with_draws, tile=TILE, interpret=True))(*args)
    want = jax.jit(block.verify_with_draws)(*args)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_inputs_cover_every_accepted_length():
    """The agreement cases are not all trivial rejections: tau takes every value 0..K."""
    lengths = set()
    for kind, seed in itertools.product(KINDS, range(3)):
        n, _ = jax.jit(block.verify_with_draws)(*verify_inputs(64, 4, 300, kind=kind, seed=seed))
        lengths |= set(np.asarray(n).tolist())
    assert lengths == set(range(5))


def test_partial_sums_add_up_to_the_reference_masses():
    target, tokens, draft, draws = verify_inputs(5, 4, 1000, kind="flat", seed=3)
    ratios = jax.jit(block.prefix_ratios)(target, tokens, draft)
    masses, _, _ = jax.jit(functools.partial(block_verify.sweep, tile=TILE, interpret=True))(target, draft,
                                                                                            draws.exponentials, ratios)
    np.testing.assert_allclose(np.asarray(masses.sum(1)),
                               np.asarray(jax.jit(block.residual_masses)(target, tokens, draft, ratios)), rtol=1e-5)


def test_one_hot_drafts_use_the_reference_path():
    target, tokens, _, draws = verify_inputs(4, 3, 500, seed=1)
    got = jax.jit(functools.partial(block_verify.verify_with_draws, tile=TILE, interpret=True))(target, tokens, None,
                                                                                               draws)
    want = jax.jit(block.verify_with_draws)(target, tokens, None, draws)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_the_sweep_lowers_through_triton_for_cuda(lower_for_cuda):
    """The lowering the GPU runs (GPU_LOWERING), at the shapes bench_verify measured."""
    from jax.experimental.pallas import triton as pltriton

    assert block_verify.GPU_LOWERING == "triton"
    batch, num_draft, vocab = 4, 5, 128256
    sweep = functools.partial(block_verify.sweep, rows_per_block=1, interpret=False,
                              compiler_params=pltriton.CompilerParams(num_warps=block_verify.TRITON_NUM_WARPS))
    args = [jax.ShapeDtypeStruct(shape, np.float32) for shape in
            ((batch, num_draft + 1, vocab), (batch, num_draft, vocab), (batch, vocab), (batch, num_draft + 1))]
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(sweep, *args)


# ------------------------------------------------------------------------- without the GPU lowering

PALLAS_SPEC = SpecConfig(rejection_sample_method="block", draft_sample_method="probabilistic", verify_impl="pallas")


@pytest.fixture
def on_a_gpu_backend(monkeypatch):
    """The verifier chooses as on a GPU (the kernel is then compiled, not interpreted); the probe's
    answer is cached per process, so it is cleared around the test."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    block_verify.kernel_available.cache_clear()
    yield
    block_verify.kernel_available.cache_clear()


def hide_the_triton_lowering(monkeypatch):
    """As on a JAX without Pallas's Triton lowering: importing it fails."""
    import jax.experimental.pallas as pallas

    monkeypatch.delattr(pallas, "triton", raising=False)
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)


@pytest.mark.parametrize("hidden, reason", [
    (True, r"ModuleNotFoundError: import of jax\.experimental\.pallas\.triton"),
    (False, r"ValueError: "),  # the lowering is there but raises: this machine's backend is the CPU
], ids=["lowering_missing", "lowering_raises"])
def test_without_a_working_lowering_pallas_falls_back_to_jnp_with_one_warning(on_a_gpu_backend, monkeypatch,
                                                                               hidden, reason):
    if hidden:
        hide_the_triton_lowering(monkeypatch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # so that a second warning would be seen
        chosen = [block_chain_verifier(PALLAS_SPEC) for _ in range(3)]
    assert chosen == [block.verify] * 3
    assert len(record) == 1
    assert re.search(r"the Pallas block verifier does not compile on gpu \(" + reason + r".*\); running the jnp "
                     r"block verifier instead", str(record[0].message)), record[0].message


def test_the_probe_instance_lowers_for_cuda(lower_for_cuda):
    """kernel_available's small instance is one the GPU lowering takes: no fallback where it works."""
    kernel, args = block_verify.small_instance("gpu")
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(kernel, *args)


def test_the_interpreted_kernel_needs_no_lowering(monkeypatch):
    hide_the_triton_lowering(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert block_chain_verifier(PALLAS_SPEC) is block_verify.verify

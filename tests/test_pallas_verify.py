"""The Pallas block-verification kernel (interpret mode on the CPU) reproduces the jnp reference
exactly from the same draws, over shapes, distribution kinds and tile boundaries; and speculative
decoding with it in place is lossless."""

import functools
import itertools

import jax
import numpy as np
import pytest

from specjax.pallas_kernels import block_verify
from specjax.verify import block
from specjax.verify.testing import KINDS, random_verify_inputs

TILE = 256  # small tiles: several per row, the last one partial (V below is not a multiple)


@pytest.mark.parametrize("batch, num_draft, vocab", [(1, 1, 1000), (3, 4, 1000), (64, 8, 700), (3, 8, 2049)])
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_equals_the_reference_exactly(batch, num_draft, vocab, kind):
    seed = batch * 1000 + num_draft * 10 + KINDS.index(kind)
    args = random_verify_inputs(batch, num_draft, vocab, kind=kind, seed=seed)
    got = jax.jit(functools.partial(block_verify.verify_with_draws, tile=TILE, interpret=True))(*args)
    want = jax.jit(block.verify_with_draws)(*args)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_inputs_cover_every_accepted_length():
    """The agreement cases are not all trivial rejections: tau takes every value 0..K."""
    lengths = set()
    for kind, seed in itertools.product(KINDS, range(3)):
        n, _ = jax.jit(block.verify_with_draws)(*random_verify_inputs(64, 4, 300, kind=kind, seed=seed))
        lengths |= set(np.asarray(n).tolist())
    assert lengths == set(range(5))


def test_partial_sums_add_up_to_the_reference_masses():
    target, tokens, draft, draws = random_verify_inputs(5, 4, 1000, kind="flat", seed=3)
    ratios = block.prefix_ratios(target, tokens, draft)
    masses, _, _ = block_verify.sweep(target, draft, draws.exponentials, ratios, tile=TILE, interpret=True)
    np.testing.assert_allclose(np.asarray(masses.sum(1)),
                               np.asarray(block.residual_masses(target, tokens, draft, ratios)), rtol=1e-5)


def test_one_hot_drafts_use_the_reference_path():
    target, tokens, _, draws = random_verify_inputs(4, 3, 500, seed=1)
    got = block_verify.verify_with_draws(target, tokens, None, draws, tile=TILE, interpret=True)
    want = block.verify_with_draws(target, tokens, None, draws)
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

"""Shared test helpers. Tests run on the CPU in float32 so that parity tolerances mean something."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from pathlib import Path  # noqa: E402

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


@pytest.fixture(params=HF_FIXTURES)
def hf_fixture(request) -> str:
    return request.param


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of observed counts to exact probabilities; 0 if any count falls
    where the probability is zero (an impossible outcome was drawn)."""
    from scipy import stats

    counts, probs = np.asarray(counts).ravel(), np.asarray(probs, np.float64).ravel()
    if np.any(counts[probs == 0]):
        return 0.0
    support = probs > 0
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(stats.chisquare(counts[support], expected).pvalue)

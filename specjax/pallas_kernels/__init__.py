"""Pallas kernels. Each has its jnp twin in specjax/verify as the reference it must reproduce."""

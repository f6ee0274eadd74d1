"""What JAX compiles while a block of a test runs, from JAX's compile events (the ones tests/conftest.py's
compile report sums): a test that a program is shared, or is not, counts them."""

import contextlib

import jax

_recording: list[list[str]] = []  # the open blocks' lists of compiled programs' names


def _record(event: str, duration: float, fun_name: str = "?", **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        for names in _recording:
            names.append(fun_name.removeprefix("jit(").removesuffix(")"))


jax.monitoring.register_event_duration_secs_listener(_record)


@contextlib.contextmanager
def compiled_programs():
    """with compiled_programs() as names: the names of the programs XLA compiled (or loaded from the persistent
    compilation cache) inside the block, one per program; a program cached in this process is not compiled."""
    names: list[str] = []
    _recording.append(names)
    try:
        yield names
    finally:
        _recording.remove(names)

"""The suite's settings, hooks and fixtures: the CPU in float32 (parity tolerances mean something),
the persistent compilation cache, the tiers (docs/testing.md) and the check that keeps loop compiles
out of the fast one, the compile report. Plain helpers live in tests/support/, one module per kind."""

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

from pathlib import Path  # noqa: E402

import jax  # noqa: E402

# Eight host devices, for the meshes of tests/test_sharding.py; everything else runs on device 0.
jax.config.update("jax_num_cpu_devices", 8)
# Many programs are compiled by several tests, by both pytest-xdist workers, by other clones and
# worktrees, and again after release_compiled_programs (below) clears the in-memory caches: JAX's
# persistent compilation cache keeps those that took 0.3 s or more to compile. That includes the engine's
# prefill and slot programs (0.3-1 s), which both workers compile (the engine files' CPU time 9% less than
# with 1 s), and not the one-op programs (well under 0.1 s; writing every program cost more than it saved).
# It lives outside the clone, so a fresh clone starts warm; the key hashes the lowered program, the compile
# options and flags, the backend and the jax/jaxlib versions, so a changed program or setting is a miss,
# never a stale hit (docs/testing.md). Kept to 2 GB, least recently used dropped first. Set in the
# environment so that the subprocesses tests start (CLI, server) share it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specjax" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_compilation_cache_max_size", 2 << 30)
# Float32 products in float32 where the suite is run on a GPU too (JAX_PLATFORMS=cuda), whose default
# is TF32 (the CPU's is float32 already): the float32 tolerances assume it.
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

from support.checkpoints import HF_FIXTURES, TRAINED_TINY_LM  # noqa: E402

# ------------------------------------------------------------------------------------------- tiers

# A test is in the fast tier (`make test-fast`, `-m fast`) unless it carries one of these markers
# (pyproject.toml says what each means); `make test` runs every tier.
FULL_TIER_MARKERS = ("loop", "e2e", "train", "slow")
# The jitted decoding loops (and the engine's loop of steps): the programs that dominate compile time.
LOOP_PROGRAMS = frozenset({"speculative_loop", "decode_loop", "run_steps"})
current_test: list = [None]  # the test being run, for the trace listener below


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(name) for name in FULL_TIER_MARKERS):
            item.add_marker(pytest.mark.fast)
        if item.get_closest_marker("xdist_group"):
            continue
        # Under --dist loadgroup (make test) the tests that share a module-scoped fixture of their file (a trained
        # drafter, a training run) run on one worker, which builds it once: split over two, each built it (the
        # Medusa heads' 25-30 s twice).
        module = item.nodeid.split("::")[0]
        if any(defs and defs[-1].scope == "module" and defs[-1].baseid == module
               for defs in item._fixtureinfo.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(f"{module}::module-fixtures"))
        # The cases of one parametrised test run on one worker, one after the other: they share programs (a
        # reference loop, a loop whose verifier is data, a fixture's), which the two workers otherwise compiled at
        # the same time, each a miss in the persistent cache.
        elif hasattr(item, "callspec"):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("[")[0]))


class XdistGroups:
    """pytest-xdist (3.8) sends a group's tests to one worker by appending "@group" to their node ids through
    `item._nodeid`, which pytest 9.2 no longer reads (Node.nodeid is str(item._id)): every xdist_group was
    ignored, so each worker started the servers of tests/test_server.py and served the load runs. This sets it
    where pytest reads it, after xdist's own hook."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if not getattr(config.option, "loadgroup", False):
            return
        from _pytest.nodeid import coerce_node_id

        for item in items:
            names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                            for mark in item.iter_markers("xdist_group")})
            if names and "@" not in item.nodeid.rpartition("]")[2]:
                item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


def pytest_configure(config):
    config.pluginmanager.register(XdistGroups(), "specjax_xdist_groups")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    current_test[0] = item
    yield


class LoopInFastTier(AssertionError):
    pass


def refuse_loops_in_the_fast_tier(event: str, duration: float, fun_name: str = "?", **_) -> None:
    """A fast-tier test that traces a decoding loop fails at once: it belongs in the `loop` tier. (A loop
    already compiled in this process by an earlier test is not traced again, so only a fast-tier run,
    where no test before it traced one, catches every case.)"""
    item = current_test[0]
    name = fun_name.removeprefix("jit(").removesuffix(")")
    if (event == "/jax/core/compile/jaxpr_trace_duration" and name in LOOP_PROGRAMS and item is not None
            and item.get_closest_marker("fast")):
        raise LoopInFastTier(f"{item.nodeid} traces {name}: mark it `loop` (tests/conftest.py, docs/testing.md)")


jax.monitoring.register_event_duration_secs_listener(refuse_loops_in_the_fast_tier)


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
compiles_by_function: dict = {}  # XLA compiles per compiled function's name (persistent cache hits included)
cache_hits_by_function: dict = {}  # ... of which were loaded from the persistent compilation cache
pending_cache_hit = [False]  # a cache hit is reported just before the compile event of its function


def record_compile_event(event: str, duration: float, fun_name: str = "?", **_) -> None:
    if event in COMPILE_EVENTS:
        totals = compile_totals.setdefault(COMPILE_EVENTS[event], [0, 0.0])
        totals[0] += 1
        totals[1] += duration
        if COMPILE_EVENTS[event] == "compile_s":
            compile_by_function[fun_name] = round(compile_by_function.get(fun_name, 0.0) + duration, 3)
            compiles_by_function[fun_name] = compiles_by_function.get(fun_name, 0) + 1
            if pending_cache_hit[0]:
                cache_hits_by_function[fun_name] = cache_hits_by_function.get(fun_name, 0) + 1
                pending_cache_hit[0] = False


def record_cache_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        pending_cache_hit[0] = True


if COMPILE_REPORT:
    jax.monitoring.register_event_duration_secs_listener(record_compile_event)
    jax.monitoring.register_event_listener(record_cache_hit)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        import json
        import time

        compile_totals.clear()
        compile_by_function.clear()
        compiles_by_function.clear()
        cache_hits_by_function.clear()
        start = time.perf_counter()
        yield
        record = {"test": item.nodeid, "wall_s": round(time.perf_counter() - start, 3),
                  "programs": compile_totals.get("compile_s", [0, 0.0])[0],
                  **{name: round(total, 3) for name, (_, total) in compile_totals.items()},
                  "xla_s_by_function": dict(compile_by_function),
                  "compiles_by_function": dict(compiles_by_function),
                  "cache_hits_by_function": dict(cache_hits_by_function)}
        with open(COMPILE_REPORT, "a") as out:
            out.write(json.dumps(record) + "\n")


@pytest.fixture(scope="session")
def trained_tiny_target() -> Path:
    """configs/train/tiny_lm.yaml trained for 800 steps of batch 8 (at its own 40 steps its greedy output
    is one repeated token, which any drafter drafts perfectly): the target the draft-training tests train
    for, committed (scripts/make_test_fixtures.py)."""
    return TRAINED_TINY_LM


@pytest.fixture(params=HF_FIXTURES)
def hf_fixture(request) -> str:
    return request.param


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

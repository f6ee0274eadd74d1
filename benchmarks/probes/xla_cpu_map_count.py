"""Why a serial run of the test suite died: XLA:CPU compiled programs each hold memory mappings.

JAX keeps every compiled program in its caches; on the CPU each one holds a few mappings of its own
(code and data sections of the JIT-linked object). A process that compiles enough distinct programs
reaches the kernel's `vm.max_map_count` (65530 by default), and the next compile fails inside LLVM
("Cannot allocate memory"), which XLA:CPU turns into a segmentation fault or an abort rather than an
exception. `jax.clear_caches()` releases the mappings.

    python benchmarks/probes/xla_cpu_map_count.py --programs 2000            # mappings per program
    python benchmarks/probes/xla_cpu_map_count.py --programs 20000           # dies near the limit
    python benchmarks/probes/xla_cpu_map_count.py --programs 20000 --clear-every 4000   # survives

Linux only (reads /proc/self/maps). The result is recorded in docs/testing.md ("One process").
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp

MAPS = pathlib.Path("/proc/self/maps")
LIMIT = pathlib.Path("/proc/sys/vm/max_map_count")


def map_count() -> int:
    return MAPS.read_bytes().count(b"\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=2000, help="distinct programs to compile")
    parser.add_argument("--clear-every", type=int, default=0, help="jax.clear_caches() every N programs (0: never)")
    args = parser.parse_args()

    limit = int(LIMIT.read_text())
    x = jnp.ones((8,), jnp.float32)
    affine = jax.jit(lambda v, c: v * c + 1.0, static_argnums=1)
    start_maps, start = map_count(), time.perf_counter()
    print(f"jax {jax.__version__}, vm.max_map_count {limit}, mappings at start {start_maps}", flush=True)
    for i in range(args.programs):
        # A distinct static constant makes a distinct program: each call compiles, and JAX keeps it.
        affine(x, float(i)).block_until_ready()
        if args.clear_every and (i + 1) % args.clear_every == 0:
            jax.clear_caches()
        if (i + 1) % 1000 == 0:
            maps = map_count()
            print(f"{i + 1:6d} programs  {maps:6d} mappings  {(maps - start_maps) / (i + 1):.2f} per program  "
                  f"{time.perf_counter() - start:6.1f} s", flush=True)
    print("finished without reaching the limit")


if __name__ == "__main__":
    main()

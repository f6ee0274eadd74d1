"""How many memory mappings XLA:CPU's compiled programs hold, towards vm.max_map_count.

A serial run of the test suite died with a segmentation fault inside XLA compilation, with memory to
spare; the explanation docs/testing.md gives is that compiled programs JAX keeps each hold memory
mappings, and that past the kernel's vm.max_map_count (65530 by default) the next compile fails inside
LLVM ("Cannot allocate memory") as a crash rather than an exception. This probe measures the first part.

    python benchmarks/probes/xla_cpu_map_count.py --programs 2000        # mappings per program
    python benchmarks/probes/xla_cpu_map_count.py --programs 14000       # where the growth stops

Measured on the 2-core machine (jax 0.12.0.1): 3.00 mappings per one-op program up to about 8,000
programs, then none more: the process stays at about 25,000 mappings (JAX's caches drop programs past
their sizes), so this probe does not reach the limit and does not reproduce the crash; a suite whose
programs are larger holds more per program. Linux only (reads /proc/self/maps).
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
    kept = []  # one jitted function per program, kept alive as a test suite's many functions are
    start_maps, start = map_count(), time.perf_counter()
    print(f"jax {jax.__version__}, vm.max_map_count {limit}, mappings at start {start_maps}", flush=True)
    for i in range(args.programs):
        # A distinct constant makes a distinct program; each function keeps its compiled program. (One
        # function called with many static arguments does not: its cache drops old entries, and the
        # mappings stop growing near 25,000.)
        kept.append(jax.jit(lambda v, c=float(i): v * c + 1.0))
        kept[-1](x).block_until_ready()
        if args.clear_every and (i + 1) % args.clear_every == 0:
            jax.clear_caches()
            kept.clear()
        if (i + 1) % 1000 == 0:
            maps = map_count()
            print(f"{i + 1:6d} programs  {maps:6d} mappings  {(maps - start_maps) / (i + 1):.2f} per program  "
                  f"{time.perf_counter() - start:6.1f} s", flush=True)
    print("finished without reaching the limit")


if __name__ == "__main__":
    main()

"""Load on the serving engine: `specjax bench-serve` (specjax/bench_serve.py) as a script, same arguments.

    python scripts/bench_serve.py --models bundled --methods none,eagle,dflash --concurrency 1,4,16 \\
        --num-requests 64 --new-tokens 64 --output benchmarks/results/bench_serve_cpu
"""

from specjax.bench_serve import main

if __name__ == "__main__":
    main()

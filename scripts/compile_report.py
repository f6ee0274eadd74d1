"""Where the test suite's time goes: sums the JSON lines tests/conftest.py writes with
SPECJAX_COMPILE_REPORT=FILE, by test file, by test and by jitted function (XLA seconds), the most
expensive first.

    rm -rf /tmp/cold && SPECJAX_COMPILE_REPORT=/tmp/report.jsonl JAX_COMPILATION_CACHE_DIR=/tmp/cold \\
        .venv/bin/python -m pytest -n 2 -q tests
    python scripts/compile_report.py /tmp/report.jsonl [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    records = [json.loads(line) for line in open(args.report)]
    keys = ("wall_s", "programs", "trace_s", "lower_s", "compile_s")
    by_file = collections.defaultdict(lambda: dict.fromkeys(keys, 0.0))
    for record in records:
        for key in keys:
            by_file[record["test"].split("::")[0]][key] += record.get(key, 0)
    total = {key: sum(row[key] for row in by_file.values()) for key in keys}
    header = "| {} | wall s | programs | trace s | lower s | XLA compile s |\n|---|---|---|---|---|---|"
    line = "| {} | {:.0f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} |"
    print(f"{len(records)} tests; compiling (trace + lower + XLA) is "
          f"{(total['trace_s'] + total['lower_s'] + total['compile_s']) / max(total['wall_s'], 1e-9):.0%} of their wall time\n")
    print(header.format("file"))
    for name, row in sorted(by_file.items(), key=lambda kv: -kv[1]["wall_s"]):
        print(line.format(name, *(row[key] for key in keys)))
    print(line.format("**all**", *(total[key] for key in keys)), "\n")
    print(header.format("test"))
    for record in sorted(records, key=lambda r: -r["wall_s"])[:args.top]:
        print(line.format(record["test"], *(record.get(key, 0) for key in keys)))
    seconds, tests = collections.Counter(), collections.Counter()
    compiles, hits = collections.Counter(), collections.Counter()
    for record in records:
        for function, duration in record.get("xla_s_by_function", {}).items():
            seconds[function] += duration
            tests[function] += 1
        compiles.update(record.get("compiles_by_function", {}))
        hits.update(record.get("cache_hits_by_function", {}))
    print("\n| jitted function | XLA compile s | compiles | of them persistent cache hits | tests compiling it |\n"
          "|---|---|---|---|---|")
    for function, duration in seconds.most_common(args.top):
        print(f"| {function} | {duration:.0f} | {compiles.get(function, '?')} | {hits.get(function, 0)} | "
              f"{tests[function]} |")
    loops = [name for name in compiles
             if name.removeprefix("jit(").removesuffix(")") in ("speculative_loop", "decode_loop", "run_steps")]
    if loops:
        print("\nloop programs compiled (persistent cache hits excluded):",
              ", ".join(f"{name} {compiles[name] - hits.get(name, 0)}" for name in loops))


if __name__ == "__main__":
    main()

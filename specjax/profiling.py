"""What a profiler trace says about the device's time: how much of a window it ran kernels, and the idle gaps
between them, which is the host's overhead the device could not hide (`bench-serve --profile`); and what the kernel
time is made of, by kind and by the kernels that took the most (a training run's `profile_steps`).

`jax.profiler.trace(log_dir, create_perfetto_trace=True)` writes `perfetto_trace.json.gz` under
`log_dir/plugins/profile/<run>/`: Chrome trace events, a `process_name` metadata event per process (the GPU's
named `/device:GPU:0 ...`) and a `thread_name` one per thread (a GPU's kernels on `Stream #N` threads, beside
derived lines such as `XLA Modules` whose spans include the gaps between kernels, so those are not counted).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

GAP_MS = 1.0  # idle gaps at least this long are counted apart: between programs, not between a program's kernels


def trace_file(log_dir: str | Path) -> Path:
    """The newest perfetto trace under log_dir."""
    found = sorted(Path(log_dir).glob("**/perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir} (jax.profiler.trace(..., "
                                "create_perfetto_trace=True) writes one)")
    return found[-1]


def kernel_threads(events: list[dict]) -> dict[tuple, str]:
    """(pid, tid) -> name of a device's kernel threads: the `Stream` threads of processes whose name names a device
    (GPU or TPU), or all of a device's threads where none is so named."""
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and any(word in str(e.get("args", {}).get("name", "")) for word in ("/device:", "GPU", "TPU"))}
    threads = {(e["pid"], e["tid"]): str(e.get("args", {}).get("name", "")) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in devices}
    streams = {key: name for key, name in threads.items() if name.startswith("Stream")}
    if streams:
        return streams
    unnamed = {(e["pid"], e.get("tid")): "" for e in events if e.get("ph") == "X" and e.get("pid") in devices}
    return {**unnamed, **threads}


def kernel_intervals(events: list[dict], threads: dict[tuple, str] | None = None) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every complete event on the kernel threads (kernel_threads)."""
    threads = kernel_threads(events) if threads is None else threads
    return [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
            if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in threads]


def device_timeline(intervals: list[tuple[float, float]]) -> dict:
    """Busy and idle time of the device over the window from its first kernel to its last (milliseconds): busy
    is the union of the kernels' spans (streams overlap), idle the rest, split into gaps of GAP_MS or more
    (between programs) and shorter ones (launch gaps inside a program)."""
    if not intervals:
        raise ValueError("the trace has no device kernels (a CPU run, or the profiler saw no device)")
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    gaps = [(b[0] - a[1]) / 1e3 for a, b in zip(merged, merged[1:])]
    long_gaps = [gap for gap in gaps if gap >= GAP_MS]
    wall = (merged[-1][1] - merged[0][0]) / 1e3
    busy = sum(end - start for start, end in merged) / 1e3
    return {"wall_ms": wall, "busy_ms": busy, "idle_ms": wall - busy, "busy_share": busy / wall if wall else 1.0,
            "long_gaps": len(long_gaps), "long_gap_ms": sum(long_gaps), "kernels": len(intervals)}


# Kinds of GPU kernels by their names (first match; lowercase): what a step's device time is made of.
KERNEL_KINDS = (
    ("attention", ("fmha", "flash", "cudnn", "attention")),
    ("matmul", ("gemm", "cublas", "cutlass", "xmma", "nvjet", "dot", "triton_gemm", "wgmma")),
    ("reduction", ("reduce", "reduction")),
    ("fusion", ("fusion", "loop_", "input_", "triton")),
    ("copy", ("memcpy", "memset", "copy", "transpose")),
)


def kernel_kind(name: str) -> str:
    """The KERNEL_KINDS kind a kernel's name says, or 'other'."""
    lowered = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(word in lowered for word in words)), "other")


def kernel_breakdown(events: list[dict], threads: dict[tuple, str] | None = None, top: int = 15) -> dict:
    """The device's kernel time (milliseconds, summed over the kernel threads: overlapping streams count twice) by
    kind (KERNEL_KINDS) and the `top` kernel names that took the most, each with its count and share."""
    threads = kernel_threads(events) if threads is None else threads
    by_name: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in threads:
            entry = by_name.setdefault(str(e.get("name", "")), [0.0, 0])
            entry[0] += float(e.get("dur", 0.0)) / 1e3
            entry[1] += 1
    total = sum(ms for ms, _ in by_name.values())
    kinds: dict[str, float] = {}
    for name, (ms, _) in by_name.items():
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {"kernel_ms": total,
            "kinds": {kind: {"ms": ms, "share": ms / total if total else 0.0}
                      for kind, ms in sorted(kinds.items(), key=lambda item: -item[1])},
            "top": [{"name": name, "kind": kernel_kind(name), "ms": ms, "count": count,
                     "share": ms / total if total else 0.0} for name, (ms, count) in ranked]}


def summarize_trace(log_dir: str | Path, breakdown: bool = False) -> dict:
    """device_timeline of the newest trace under log_dir, and the file it read; with breakdown, kernel_breakdown's."""
    path = trace_file(log_dir)
    with gzip.open(path, "rt") as handle:
        trace = json.load(handle)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    threads = kernel_threads(events)
    # The threads counted, so that a reader sees which lines of the trace the figures come from.
    return {**device_timeline(kernel_intervals(events, threads)), "threads": sorted(set(threads.values())),
            "trace": str(path), **({"breakdown": kernel_breakdown(events, threads)} if breakdown else {})}

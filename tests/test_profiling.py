"""specjax.profiling: the device's busy time and idle gaps read from a profiler trace's events."""

import gzip
import json

import pytest

from specjax import profiling


def trace_events(kernels, module_span=None):
    """Chrome trace events as JAX's perfetto trace writes them: a host process, a GPU process with two streams
    and a derived 'XLA Modules' line whose span covers the gaps between its kernels."""
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "python"}},
              {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0 NVIDIA H200"}},
              {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
              {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8(MemcpyD2H)"}},
              {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "XLA Modules"}},
              {"ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 99_000.0, "name": "Engine.step"}]
    events += [{"ph": "X", "pid": 2, "tid": tid, "ts": ts, "dur": dur, "name": "k"} for tid, ts, dur in kernels]
    if module_span:
        events.append({"ph": "X", "pid": 2, "tid": 9, "ts": module_span[0], "dur": module_span[1], "name": "m"})
    return events


def test_busy_time_is_the_union_of_stream_kernels_and_long_gaps_are_counted_apart():
    # Microseconds: 0-1000 and 500-1500 overlap on two streams (1.5 ms busy), a 0.5 ms launch gap, 2000-3000,
    # then a 4 ms gap between programs, 7000-8000. The module line spans everything and must not fill the gaps.
    kernels = [(7, 0.0, 1000.0), (8, 500.0, 1000.0), (7, 2000.0, 1000.0), (7, 7000.0, 1000.0)]
    timeline = profiling.device_timeline(profiling.kernel_intervals(trace_events(kernels, (0.0, 8000.0))))
    assert timeline["wall_ms"] == pytest.approx(8.0)
    assert timeline["busy_ms"] == pytest.approx(3.5)
    assert timeline["idle_ms"] == pytest.approx(4.5)
    assert timeline["long_gaps"] == 1 and timeline["long_gap_ms"] == pytest.approx(4.0)
    assert timeline["kernels"] == 4  # the host's span and the module line are not kernels


def test_a_trace_without_device_kernels_is_refused_and_a_missing_trace_names_the_directory(tmp_path):
    with pytest.raises(ValueError, match="no device kernels"):
        profiling.device_timeline(profiling.kernel_intervals(trace_events([])))
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        profiling.trace_file(tmp_path)
    run = tmp_path / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as handle:
        json.dump({"traceEvents": trace_events([(7, 0.0, 2000.0), (7, 3000.0, 1000.0)])}, handle)
    summary = profiling.summarize_trace(tmp_path)
    assert summary["busy_share"] == pytest.approx(0.75) and summary["trace"].endswith("perfetto_trace.json.gz")
    assert summary["threads"] == ["Stream #7(Compute)", "Stream #8(MemcpyD2H)"]  # not the 'XLA Modules' line


def test_kernel_time_is_broken_down_by_kind_and_by_the_kernels_that_took_most():
    """Durations summed per kernel name over the kernel threads (not the host's span, not the 'XLA Modules' line),
    each name's kind from KERNEL_KINDS, shares of the kernel time."""
    events = trace_events([], (0.0, 9000.0))
    for tid, ts, dur, name in [(7, 0.0, 3000.0, "sm90_xmma_gemm_bf16"), (7, 3000.0, 1000.0, "sm90_xmma_gemm_bf16"),
                               (7, 4000.0, 2000.0, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"),
                               (8, 4500.0, 500.0, "loop_multiply_fusion"), (7, 6000.0, 1500.0, "input_reduce_fusion"),
                               (7, 7500.0, 2000.0, "fusion.12")]:
        events.append({"ph": "X", "pid": 2, "tid": tid, "ts": ts, "dur": dur, "name": name})
    breakdown = profiling.kernel_breakdown(events, top=2)
    assert breakdown["kernel_ms"] == pytest.approx(10.0)
    assert {kind: round(v["ms"], 3) for kind, v in breakdown["kinds"].items()} == {
        "matmul": 4.0, "fusion": 2.5, "attention": 2.0, "reduction": 1.5}
    assert list(breakdown["kinds"]) == ["matmul", "fusion", "attention", "reduction"]  # most first
    assert [(k["name"], k["count"], k["share"]) for k in breakdown["top"]] == [
        ("sm90_xmma_gemm_bf16", 2, pytest.approx(0.4)),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 1, pytest.approx(0.2))]
    assert profiling.kernel_kind("something_else") == "other"

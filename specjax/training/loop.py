"""The training loop every trainer shares: checkpoints that resume where a killed run stopped and
refuse to load corrupt data, JSONL metrics that match the restored step (and TensorBoard event files
where tensorboardX is installed), a progress bar, and a profiler window of a few steps (profile_steps).

Resuming reproduces an uninterrupted run because nothing outside the checkpoint decides what happens
next: batches are a function of (seed, step) and the state holds parameters, optimizer state and
the step. Each checkpoint carries a manifest of SHA-256 digests of every array; a restore that does
not reproduce them is refused (CheckpointCorrupted), as is one orbax cannot read. Orbax writes each
step to a temporary folder and renames it when complete, so a run killed mid-save leaves no
half-written step behind to load.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from specjax import profiling, sharding

PROFILE_AFTER = 5  # steps run before a profiler window opens: the first compiles, the next few warm up


class CheckpointCorrupted(RuntimeError):
    """A checkpoint that cannot be read back exactly; the message names its folder and what differs."""


def digests(state: Any) -> dict[str, str]:
    return {jax.tree_util.keystr(path): hashlib.sha256(np.ascontiguousarray(leaf).tobytes()).hexdigest()
            for path, leaf in jax.tree_util.tree_leaves_with_path(sharding.to_host(state))}


class Checkpoints:
    """An orbax CheckpointManager over `directory`, with the digest manifest."""

    def __init__(self, directory: Path, max_to_keep: int = 3):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=False))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         manifest=ocp.args.JsonSave(digests(state))))
        self.manager.wait_until_finished()

    def restore(self, step: int, like: Any) -> Any:
        """The state saved at `step`, checked against its manifest; `like` gives structure and dtypes."""
        where = self.directory / str(step)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), manifest=ocp.args.JsonRestore()))
        except Exception as error:  # orbax and tensorstore raise many types for unreadable data
            raise CheckpointCorrupted(f"checkpoint {where} cannot be read: {type(error).__name__}: {error}") from error
        expected, actual = restored["manifest"], digests(restored["state"])
        differing = sorted(key for key in expected.keys() | actual.keys() if expected.get(key) != actual.get(key))
        if differing:
            raise CheckpointCorrupted(f"checkpoint {where} does not match its manifest: {len(differing)} arrays "
                                      f"differ, first {differing[0]}; delete the step folder to resume from an "
                                      "earlier one")
        return restored["state"]


def run(state: Any, train_step: Callable, batch_fn: Callable[[int], Any], *, total_steps: int, output_dir: Path,
        checkpoint_every: int, log_every: int, description: str = "train", profile_steps: int = 0) -> Any:
    """Runs train_step(state, batch_fn(step)) -> (state, metrics) for steps 1..total_steps, resuming
    from the latest checkpoint under output_dir/checkpoints; appends metrics to output_dir/metrics.jsonl.
    profile_steps: that many steps, from the PROFILE_AFTER-th after the start on, traced (profile_window)."""
    output_dir = Path(output_dir)
    checkpoints = Checkpoints(output_dir / "checkpoints")
    metrics_path = output_dir / "metrics.jsonl"
    start = checkpoints.latest_step() or 0
    if start:
        state = checkpoints.restore(start, state)
        print(f"{description}: resumed from step {start} of {total_steps} ({checkpoints.directory / str(start)})",
              file=sys.stderr)
    _truncate_metrics(metrics_path, start)
    tensorboard = _tensorboard_writer(output_dir / "tensorboard", start)
    window = range(start + PROFILE_AFTER + 1, min(start + PROFILE_AFTER + profile_steps, total_steps) + 1)
    if profile_steps and not window:
        print(f"{description}: profile_steps={profile_steps}: nothing traced, the run has no steps past its "
              f"first {PROFILE_AFTER} after step {start}", file=sys.stderr)
    try:
        with metrics_path.open("a") as log, tqdm(total=total_steps, initial=start, desc=description) as bar:
            for step in range(start + 1, total_steps + 1):
                if window and step == window.start:
                    jax.block_until_ready(state)
                    jax.profiler.start_trace(str(output_dir / "profile"), create_perfetto_trace=True)
                state, metrics = train_step(state, batch_fn(step))
                if window and step == window[-1]:
                    profile_window(state, output_dir, window)
                if step % log_every == 0 or step == total_steps:
                    record = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()},
                              "time": time.time()}
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    if tensorboard is not None:
                        for name, value in record.items():
                            if name not in ("step", "time"):
                                tensorboard.add_scalar(f"train/{name}", value, step)
                        tensorboard.flush()
                    bar.set_postfix(loss=f"{record.get('loss', float('nan')):.4f}")
                if step % checkpoint_every == 0 or step == total_steps:
                    checkpoints.save(step, state)
                bar.update(1)
    finally:  # after a failed step too: an open writer's thread fails at interpreter shutdown
        if tensorboard is not None:
            tensorboard.close()
    return state


def profile_window(state: Any, output_dir: Path, window: range) -> dict:
    """Ends the trace of the window's steps (after they ran) and writes what it says to output_dir/profile.json:
    specjax.profiling's device timeline and kernel breakdown, per step where it is a sum; on a CPU, which has no
    device kernels, the trace's file and why. Prints its first line."""
    jax.block_until_ready(state)
    jax.profiler.stop_trace()
    steps = len(window)
    try:
        summary = profiling.summarize_trace(output_dir / "profile", breakdown=True)
        summary["breakdown"]["kernel_ms_per_step"] = summary["breakdown"]["kernel_ms"] / steps
        line = (f"device busy {summary['busy_share']:.1%} of {summary['wall_ms'] / steps:.1f} ms a step; kernel time "
                + ", ".join(f"{kind} {v['share']:.0%}" for kind, v in summary["breakdown"]["kinds"].items()))
    except ValueError as error:
        summary = {"trace": str(profiling.trace_file(output_dir / "profile")), "device": str(error)}
        line = str(error)
    summary.update(first_step=window.start, steps=steps)
    (output_dir / "profile.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"profile of steps {window.start}-{window[-1]}: {line} ({output_dir / 'profile.json'})", file=sys.stderr)
    return summary


def _tensorboard_writer(directory: Path, start: int):
    """A TensorBoard writer when tensorboardX is installed (`pip install specjax[tensorboard]`), else None.
    purge_step makes TensorBoard hide the events a killed run wrote past the restored step."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(directory), purge_step=start + 1 if start else None)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drops records past the restored step: the resumed run writes them again."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]

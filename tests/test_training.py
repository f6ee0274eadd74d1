"""Training: a killed run resumes to exactly the uninterrupted result, corrupt checkpoints are
refused, configs are strict."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from support.checkpoints import REPO

from specjax.config import ConfigError, TrainConfig, load_yaml
from specjax.training.loop import CheckpointCorrupted, Checkpoints, read_metrics

pytestmark = pytest.mark.train  # each test trains, resumes or reads a training run (tests/conftest.py: tiers)

CONFIG = REPO / "configs/train/tiny_lm.yaml"
TOTAL_STEPS = 40


def train_command(output_dir):
    return [sys.executable, "-m", "specjax.cli", "train-lm", "--config", str(CONFIG), "--set", f"output_dir={output_dir}"]


def run_to_end(output_dir, *sets: str) -> str:
    """Runs (or resumes) the training command to its end, with more --set overrides; its stderr."""
    command = train_command(output_dir) + [arg for value in sets for arg in ("--set", value)]
    return subprocess.run(command, check=True, cwd=REPO, capture_output=True, text=True).stderr


def final_params(output_dir):
    checkpoints = Checkpoints(Path(output_dir) / "checkpoints")
    step = checkpoints.latest_step()
    path = Path(output_dir) / "checkpoints" / str(step) / "state"
    import orbax.checkpoint as ocp

    return step, ocp.StandardCheckpointer().restore(path)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run the others compare with; it traces three steps with the profiler, which must change nothing."""
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    (output_dir / "stderr.txt").write_text(run_to_end(output_dir, "profile_steps=3"))
    return output_dir


def test_a_killed_run_resumes_to_the_uninterrupted_result(uninterrupted, tmp_path):
    # Kill at a random step (SIGKILL: no chance to clean up), possibly mid-checkpoint.
    kill_at = random.Random(os.getpid()).randint(8, TOTAL_STEPS - 5)
    process = subprocess.Popen(train_command(tmp_path), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and any(json.loads(line)["step"] >= kill_at for line in metrics.read_text().splitlines()
                                    if line.strip()):
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = max(json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip())
    assert killed_at < TOTAL_STEPS, "the run finished before it could be killed"
    stderr = run_to_end(tmp_path)  # resumes from the last checkpoint, and says so
    resumed_from = re.search(rf"train-lm: resumed from step (\d+) of {TOTAL_STEPS} \(", stderr)
    assert resumed_from and 0 < int(resumed_from.group(1)) <= killed_at, stderr

    # Same loss trajectory step by step, and the same final parameters, exactly: XLA is deterministic
    # on the CPU, and on GPUs with the deterministic ops tests/conftest.py asks for.
    resumed, reference = read_metrics(tmp_path / "metrics.jsonl"), read_metrics(uninterrupted / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, TOTAL_STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]
    step_a, state_a = final_params(tmp_path)
    step_b, state_b = final_params(uninterrupted)
    assert step_a == step_b == TOTAL_STEPS
    for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    evaluation = json.loads((tmp_path / "model/eval.json").read_text())
    assert evaluation == json.loads((uninterrupted / "model/eval.json").read_text())
    assert evaluation["held_out_loss"] < np.log(300)  # it learned something beyond uniform


def test_a_corrupt_checkpoint_is_refused(uninterrupted, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(uninterrupted, copy)
    step_dir = copy / "checkpoints" / str(TOTAL_STEPS) / "state"
    data_files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.stat().st_size > 1000)
    assert data_files
    victim = data_files[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte in the stored arrays
    victim.write_bytes(bytes(raw))
    checkpoints = Checkpoints(copy / "checkpoints")
    _, like = final_params(uninterrupted)
    with pytest.raises(CheckpointCorrupted, match=rf"checkpoint .*{TOTAL_STEPS}"):
        checkpoints.restore(TOTAL_STEPS, like)


def test_a_truncated_checkpoint_is_refused(uninterrupted, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(uninterrupted, copy)
    for path in (copy / "checkpoints" / str(TOTAL_STEPS) / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 1000:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    _, like = final_params(uninterrupted)
    with pytest.raises(CheckpointCorrupted, match=rf"checkpoint .*{TOTAL_STEPS}"):
        Checkpoints(copy / "checkpoints").restore(TOTAL_STEPS, like)


@pytest.mark.parametrize("override, message", [
    # An unknown key given with --set is blamed on the --set, not on the file.
    ("optimizer.learning_rate=1e-3", r"^--set optimizer.learning_rate=1e-3: unknown key 'learning_rate' in optimizer "
                                     r"\(OptimizerConfig\): allowed \["),
    ("data.seq_len=long", r"tiny_lm.yaml with --set data.seq_len=long: DataConfig.seq_len = 'long' is invalid: "
                          r"allowed an integer"),
    ("data.seq_len=[1,", r"^--set data.seq_len=\[1,: malformed YAML at line 1, column 4: while parsing a flow node: "
                         r"expected the node content"),
    ("model.norm=batch", r"ModelConfig.norm = 'batch' is invalid: allowed one of \['rms', 'layer'\]"),
    ("optimizer.lr=fast", r"OptimizerConfig.lr = 'fast' is invalid: allowed a number"),
    ("checkpoint_every", r"--set 'checkpoint_every' is invalid: allowed key=value"),
])
def test_bad_training_configs_name_the_key_and_file(override, message):
    with pytest.raises(ConfigError, match=message):
        load_yaml(TrainConfig, CONFIG, [override])


def test_the_run_config_is_written_beside_its_metrics_as_resolved(uninterrupted):
    """run_config.json holds the file's values with the --set applied (output_dir here)."""
    import yaml

    written = json.loads((uninterrupted / "run_config.json").read_text())
    source = yaml.safe_load(CONFIG.read_text())
    assert written["class"] == "TrainConfig" and written["output_dir"] == str(uninterrupted)
    assert written["optimizer"]["total_steps"] == source["optimizer"]["total_steps"] == TOTAL_STEPS
    assert written["data"]["batch_size"] == source["data"]["batch_size"]
    assert written["model"]["hidden_size"] == source["model"]["hidden_size"]


def test_a_profiled_window_writes_its_trace_and_what_it_says(uninterrupted):
    """profile_steps=3: steps 6 to 8 traced (the first five compile and warm up), profile.json beside the metrics; on
    a CPU, which has no device kernels, it names the trace and says so (a GPU's: tests/test_profiling.py)."""
    profile = json.loads((uninterrupted / "profile.json").read_text())
    assert profile["first_step"] == 6 and profile["steps"] == 3
    assert Path(profile["trace"]).exists() and str(uninterrupted / "profile") in profile["trace"]
    assert "no device kernels" in profile["device"]
    assert "profile of steps 6-8: " in (uninterrupted / "stderr.txt").read_text()


def test_tensorboard_events_carry_the_logged_losses(uninterrupted):
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    losses = {}
    for path in (uninterrupted / "tensorboard").glob("events.out.tfevents.*"):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):  # TFRecord framing: length (8 bytes), its CRC (4), payload, its CRC (4)
            length = int.from_bytes(data[offset:offset + 8], "little")
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 16 + length
            for value in event.summary.value:
                if value.tag == "train/loss":
                    losses[event.step] = value.simple_value
    logged = {r["step"]: r["loss"] for r in read_metrics(uninterrupted / "metrics.jsonl")}
    assert losses.keys() == logged.keys()
    np.testing.assert_allclose([losses[s] for s in sorted(losses)], [logged[s] for s in sorted(logged)], rtol=1e-6)

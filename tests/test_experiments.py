"""Experiments: `specjax run` and `specjax sweep` end to end on tiny models, a killed sweep resumed to
the uninterrupted results, and config errors that name the key, the file and what is allowed."""

import dataclasses
import json
import signal
import subprocess
import sys
import time

import pytest
import yaml
from support.checkpoints import REPO, write_tiny_checkpoint

from specjax import cli
from specjax.config import ConfigError, SamplingConfig, SpecConfig
from specjax.experiments import TIMING_FIELDS, load_run, load_sweep
from specjax.models import hf
from specjax.models.eagle import EagleConfig, init_eagle, save_eagle
from specjax.proposers import build_proposer

PROMPTS = ["def add(", "for item in", "total +=", "def sub(a, b):", "return a"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name in ("target", "draft"):  # the same seed: a draft equal to the target, every draft accepted
        write_tiny_checkpoint(root / name, seed=0)
    (root / "prompts.json").write_text(json.dumps(PROMPTS))
    return root


def run_config(models, path, **changes):
    config = {"target": str(models / "target"), "drafter": str(models / "draft"),
              "prompts_file": str(models / "prompts.json"), "max_new_tokens": 12,
              "spec": {"method": "draft_model", "num_speculative_tokens": 3}}
    config.update(changes)
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.e2e
def test_run_prints_the_table_and_greedy_matches(models, tmp_path, capsys):
    assert cli.main(["run", str(run_config(models, tmp_path / "run.yaml"))]) == 0
    out = capsys.readouterr().out
    prompts = len(json.loads((models / "prompts.json").read_text()))
    assert "| draft_model | 3 | greedy | 0 | greedy |" in out and f"| {prompts}/{prompts} |" in out  # T 0: greedy verifier
    assert "per-position acceptance:" in out


@pytest.mark.e2e
def test_a_run_with_a_draft_vocabulary_stays_lossless(models, tmp_path, capsys):
    """FR-Spec from a config: the EAGLE-1 head drafts over the corpus' 40 most frequent ids, and greedy
    output is still the target's own."""
    target = hf.load(models / "target")
    save_eagle(init_eagle(EagleConfig(layer=dataclasses.replace(target.config, num_layers=1)), seed=0),
               tmp_path / "eagle")
    config = run_config(models, tmp_path / "run.yaml", drafter=str(tmp_path / "eagle"), draft_vocab_size=40,
                        spec={"method": "eagle", "num_speculative_tokens": 3}, corpus={"max_files": 40, "held_out_fraction": 0.5})
    assert cli.main(["run", str(config)]) == 0
    prompts = len(PROMPTS)
    assert "| eagle (40 ids) | 3 | greedy | 0 | greedy |" in (out := capsys.readouterr().out)
    assert f"| {prompts}/{prompts} |" in out


def sweep_config(models, path, output_dir):
    base = yaml.safe_load(run_config(models, path.with_suffix(".base.yaml")).read_text())
    path.write_text(yaml.safe_dump({"base": base, "output_dir": str(output_dir), "grid": {
        "spec.num_speculative_tokens": [1, 2, 3], "spec.method": ["draft_model", "ngram"]}}))
    return path


def deterministic(record):
    return {k: v for k, v in record.items() if k not in TIMING_FIELDS}


@pytest.mark.e2e
def test_a_killed_sweep_reruns_only_the_missing_points(models, tmp_path):
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    reference = sweep_config(models, tmp_path / "reference.yaml", reference_dir)
    killed = sweep_config(models, tmp_path / "killed.yaml", killed_dir)
    assert cli.main(["sweep", str(reference)]) == 0
    expected = [json.loads(line) for line in (reference_dir / "results.jsonl").read_text().splitlines()]
    assert len(expected) == 6
    # The batch's loop runs as many steps as its slowest row (loop_steps), a row on average mean_row_steps.
    assert all(row["loop_steps"] >= row["mean_row_steps"] > 0 for row in expected)

    process = subprocess.Popen([sys.executable, "-m", "specjax.cli", "sweep", str(killed)], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = killed_dir / "results.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if results.exists() and len(results.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = results.read_text().splitlines()
    assert 2 <= len(before) < 6, "the sweep was not killed midway"
    assert cli.main(["sweep", str(killed)]) == 0
    after = results.read_text().splitlines()
    assert after[:len(before)] == before  # finished points were not run again
    assert len(after) == 6
    assert sorted(map(json.dumps, map(deterministic, map(json.loads, after)))) == \
        sorted(map(json.dumps, map(deterministic, expected)))
    for name in ("results.csv", "results.md", "acceptance_vs_k.png", "speedup_vs_k.png",
                 "per_position_acceptance.png"):
        assert (killed_dir / name).stat().st_size > 0


@pytest.mark.parametrize("changes, message", [
    (dict(num_prompt=3), r"run.yaml: unknown key 'num_prompt' in RunConfig: allowed \["),
    (dict(max_new_tokens="many"), r"run.yaml: RunConfig.max_new_tokens = 'many' is invalid: allowed an integer"),
    (dict(spec={"method": "lookahead"}), r"run.yaml: SpecConfig.method = 'lookahead' is invalid: allowed one of "
                                         r"\['dflash', 'draft_model', 'dspark', 'eagle', 'eagle3', 'medusa', "
                                         r"'mtp', 'ngram'\]"),
    (dict(spec={"num_speculative_tokens": 0}), r"run.yaml: SpecConfig.num_speculative_tokens = 0 is invalid"),
    (dict(draft_vocab_size=100), r"run.yaml: RunConfig.draft_vocab_size = 100 is invalid with spec.method "
                                 r"'draft_model': allowed null, or a positive integer with methods "
                                 r"\['dflash', 'eagle'\]"),
])
def test_bad_run_configs_name_the_key_file_and_allowed_values(models, tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        load_run(run_config(models, tmp_path / "run.yaml", **changes))


@pytest.mark.parametrize("prompts, message", [
    ([[1, 2, 3], [4]], None),
    (["def add(", "x ="], None),
    ([[1, 2], [3, 10_000]], r"prompts.json': allowed a non-empty JSON list of prompt strings, or of non-empty lists "
                            r"of token ids in \[0, 1000\)"),
    ([[1, 2], []], r"allowed a non-empty JSON list"),
    ([], r"allowed a non-empty JSON list"),
])
def test_a_prompts_file_gives_strings_or_token_ids_and_refuses_ids_outside_the_vocabulary(tmp_path, prompts, message):
    """Token-id prompts reach the run as they are (Spec-Bench's categories cut them to one length)."""
    from specjax.experiments import RunConfig, load_prompts

    class Tokenizer:  # a vocabulary of 1,000 ids whose encoding of a string is its characters' codes
        def __len__(self):
            return 1000

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    config = RunConfig(target="unused", spec=SpecConfig(method="ngram"), prompts_file=str(tmp_path / "prompts.json"))
    if message is not None:
        with pytest.raises(ConfigError, match=message):
            load_prompts(config, Tokenizer())
    else:
        expected = [[ord(c) for c in p] if isinstance(p, str) else p for p in prompts]
        assert load_prompts(config, Tokenizer()) == expected


def test_a_bad_grid_key_is_named(models, tmp_path):
    path = sweep_config(models, tmp_path / "sweep.yaml", tmp_path / "out")
    config = yaml.safe_load(path.read_text())
    config["grid"] = {"spec.num_draft_tokens": [1, 2]}
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"sweep.yaml: grid key 'spec.num_draft_tokens': SpecConfig has no field "
                                          r"'num_draft_tokens': allowed \["):
        load_sweep(path)


def test_every_speed_table_drafter_is_built_by_its_proposer_and_fits_the_target():
    from specjax import benchmarking, speed

    target_config, draft_config = benchmarking.SHAPES["tiny"]
    assert {"eagle", "eagle_fr", "eagle3", "draft_model", "dflash", "dflash_fr", "mtp"} <= set(speed.DRAFTERS)
    for name in speed.DRAFTERS:
        weights = speed.build_drafter(name, target_config, draft_config)
        spec = SpecConfig(method=speed.spec_method(name), num_speculative_tokens=2)
        proposer = build_proposer(spec, SamplingConfig(), cache_size=16, drafter=weights)
        proposer.check(weights, target_config)  # raises where the shaped drafter does not fit
        assert (getattr(weights, "draft_to_target", None) is not None) == name.endswith("_fr") or name == "eagle3"
    with pytest.raises(ValueError, match=r"drafter 'medusa' is unknown: allowed dflash, dflash_fr"):
        speed.build_drafter("medusa", target_config, draft_config)


def test_the_8b_speed_table_is_skipped_off_gpus_with_a_reason(capsys):
    assert cli.main(["speed", "--output", "unused"]) == 0
    assert capsys.readouterr().out == ("8b-shaped speed table skipped: it needs a GPU (backend here: cpu); "
                                       "`specjax speed` on a GPU shows where speculation pays\n")


def test_benchmark_rows_and_requests_each_have_their_own_seed():
    """Synthetic acceptance draws from a row's seed: with one seed for all, every row of a batch accepted alike
    (adaptive verification then read 16 rows as one), and in-process serving was an easier load than HTTP's."""
    import types

    import jax
    import numpy as np

    from specjax import benchmarking, speed
    from specjax.bench_serve import request_for

    target = types.SimpleNamespace(config=benchmarking.SHAPES["tiny"][0])
    keys = np.asarray(jax.random.key_data(speed.generation_args(target, 4, 8, 4, 2, 32)[3]))  # [rows, ...]
    assert len({row.tobytes() for row in keys}) == 4
    assert [request_for(i, [[1, 2], [3]], 4).seed for i in range(3)] == [0, 1, 2]


def test_bench_serve_draws_each_requests_budget_from_its_index_alone(capsys):
    """--random-range-ratio: request i asks for the same new tokens in process and from any HTTP client process
    (the index alone draws it), within [N (1 - R), N (1 + R)], spread over that range; R 0 gives N to all."""
    from specjax.bench_serve import main, new_tokens_of, request_for

    budgets = [new_tokens_of(i, 192, 1 / 3) for i in range(2000)]
    assert budgets == [new_tokens_of(i, 192, 1 / 3) for i in range(2000)]
    assert min(budgets) == 128 and max(budgets) == 256 and len(set(budgets)) == 129
    assert [request_for(i, [[1]], 192, 1 / 3).max_tokens for i in range(5)] == budgets[:5]
    assert {new_tokens_of(i, 64) for i in range(50)} == {64}
    with pytest.raises(SystemExit):
        main(["--models", "tiny", "--random-range-ratio", "1"])
    assert "--random-range-ratio 1.0 is invalid: allowed 0 <= R < 1" in capsys.readouterr().err


@pytest.mark.loop
def test_bench_serve_in_process_serves_each_request_its_own_budget_under_each_visit_ends(tmp_path):
    """The in-process path end to end on the tiny shape (no speculation, random weights, no EOS): a row per
    --visit-ends setting, each point's requests all served with the budgets --random-range-ratio gave them."""
    import json

    from specjax.bench_serve import main, new_tokens_of

    main(["--models", "tiny", "--methods", "none", "--concurrency", "3", "--max-num-seqs", "2", "--num-requests", "6",
          "--prompt-len", "8",
          "--new-tokens", "6", "--random-range-ratio", "0.5", "--visit-ends", "auto,1", "--steps-per-visit", "2",
          "--name", "ends", "--output", str(tmp_path)])
    rows = json.loads((tmp_path / "ends.json").read_text())["rows"]
    assert [(row["label"], row["visit_ends"]) for row in rows] == [("none ends auto", "auto"), ("none ends 1", "1")]
    for row in rows:
        assert row["requests"] == 6 and row["output_tokens"] == sum(new_tokens_of(i, 6, 0.5) for i in range(6))
        assert row["visits"] >= 1 and row["steps"] >= max(new_tokens_of(i, 6, 0.5) for i in range(6)) - 1
        # The wait for the six prefills' first tokens is part of the device's and is left out of a decode step's.
        assert 0 < row["decode_ms_per_step"] < row["device_ms_per_step"]


@pytest.mark.loop
def test_bench_serve_runs_adaptive_points_with_and_without_held_visits(tmp_path):
    """--held-visits on,off,whole: an adaptive method's point under each (the engine's held visits, a share of its
    steps with them on or whole and none off), a method without adaptive verification once."""
    import json

    from specjax.bench_serve import main

    main(["--models", "tiny", "--methods", "none,dflash:3::adaptive", "--acceptance-rates", "0.9,0.9,0.9",
          "--concurrency", "1", "--max-num-seqs", "1", "--num-requests", "2", "--prompt-len", "8", "--new-tokens", "24",
          "--held-visits", "on,off,whole", "--steps-per-visit", "2", "--name", "held", "--output", str(tmp_path)])
    rows = json.loads((tmp_path / "held.json").read_text())["rows"]
    assert [(row["label"], row["held_visits"]) for row in rows] == [
        ("none", None), ("dflash K=3 adaptive held on", "on"), ("dflash K=3 adaptive held off", "off"),
        ("dflash K=3 adaptive held whole", "whole")]
    assert rows[0]["held_share"] is None and 0 < rows[1]["held_share"] <= 1 and rows[2]["held_share"] == 0
    assert 0 < rows[3]["held_share"] <= 1


def test_bench_serve_plot_draws_the_points_of_several_results_files_as_one_line_a_label(tmp_path, monkeypatch):
    """--plot: the rows of results files run apart (one load each) in one plot, each label's points in load order
    across the files; the widths panel's lines are what plot returns."""
    import json

    from specjax import bench_serve

    def row(label, load, width, adaptive=True):
        return {"label": label, "load": load, "adaptive": adaptive, "output_tok_s": 10.0 * load, "tpot_mean_ms": 2.0,
                "mean_verified_width": width}
    files = {"c16.json": [row("K=8", 16, 8, False), row("adaptive", 16, 7.1)], "c1.json": [row("adaptive", 1, 15)],
             "c64.json": [row("adaptive", 64, 3.3), row("K=3", 64, 3, False)]}
    for name, rows in files.items():
        (tmp_path / name).write_text(json.dumps({"meta": {"load": "requests in flight"}, "rows": rows}))
    drawn, real = [], bench_serve.plot
    monkeypatch.setattr(bench_serve, "plot", lambda *args: drawn.append(real(*args)))
    bench_serve.main(["--plot", *(str(tmp_path / name) for name in files), "--name", "loads", "--output",
                      str(tmp_path)])
    assert (tmp_path / "loads.png").stat().st_size > 0
    assert drawn == [{"K=8": [(16, 8)], "adaptive": [(1, 15), (16, 7.1), (64, 3.3)], "K=3": [(64, 3)]}]


def test_bench_serve_points_serve_requests_per_stream_and_refuse_fewer_than_one(capsys):
    import argparse

    from specjax.bench_serve import main, point_requests

    args = argparse.Namespace(num_requests=8, requests_per_stream=8)
    assert [point_requests(args, load) for load in (1, 64, 256)] == [8, 512, 2048]
    with pytest.raises(SystemExit):
        main(["--models", "tiny", "--requests-per-stream", "0"])
    assert "--requests-per-stream 0 is invalid: allowed 1 or more" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, bad, allowed", [
    ("--prefix-caching", "off,on", "'on'", "['off', 'drop', 'keep']"),
    ("--draft-kv-offload", "off,x", "'x'", "['off', 'on']"),
    ("--mixed-prefill", "64x0", "'64x0'", "off and TOKENS[xCHUNKS] (positive integers)"),
    ("--async-scheduling", "yes", "'yes'", "['off', 'on']"),
    ("--visit-ends", "auto,0", "'0'", "auto and positive integers"),
    ("--prefill-call-rows", "1,-1", "'-1'", "numbers >= 0 and inf"),
    ("--held-visits", "on,maybe", "'maybe'", "['whole', 'on', 'off']"),
])
def test_bench_serve_refuses_a_bad_item_of_a_list_flag_naming_the_flag_the_item_and_what_is_allowed(
        capsys, flag, value, bad, allowed):
    from specjax.bench_serve import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--models", "tiny", flag, value])
    assert exit_info.value.code == 2
    assert f"{flag} {bad} is invalid: allowed a comma-separated list of {allowed}" in capsys.readouterr().err


def test_bench_serve_takes_a_per_position_acceptance_profile_for_every_speculative_method(capsys):
    from specjax.bench_serve import Method, main

    with pytest.raises(SystemExit):
        main(["--models", "tiny", "--methods", "dflash:2", "--acceptance-rates", "0.7,1.5"])
    assert ("--acceptance-rates '0.7,1.5': SpecConfig.synthetic_acceptance_rates = (0.7, 1.5) is invalid"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):  # the bundled models' acceptance is their own
        main(["--methods", "eagle:2", "--acceptance-rates", "0.7"])
    assert "--acceptance-rates: synthetic acceptance is for the shaped models" in capsys.readouterr().err
    method = dataclasses.replace(Method.parse("dflash:2::adaptive"), rates=(0.7, 0.45, 0.33))
    spec = method.spec()
    assert spec.synthetic_acceptance_rates == (0.7, 0.45) and spec.enable_adaptive_verification
    assert spec.rejection_sample_method == "synthetic" and method.synthetic_tau == pytest.approx(2.15)


def test_bench_serve_plots_each_label_in_one_colour_in_every_panel(monkeypatch, tmp_path):
    # The static peer has throughput but no TPOT: before, each panel coloured its lines in its own order.
    from specjax import bench_serve, benchmarking

    figures = []
    monkeypatch.setattr(benchmarking, "save_figure", lambda fig, path: figures.append(fig))
    rows = [{"label": "static generate AR", "load": 64, "output_tok_s": 9.0}]
    rows += [{"label": label, "load": load, "output_tok_s": 5.0, "tpot_mean_ms": 2.0}
             for label in ("none", "eagle K=2") for load in (1, 64)]
    bench_serve.plot(rows, tmp_path / "plot.png", "requests in flight")
    left, right = figures[0].axes
    colours = [{line.get_label(): line.get_color() for line in axis.get_lines()} for axis in (left, right)]
    figures[0].clear()
    assert set(colours[1]) == {"none", "eagle K=2"}
    assert all(colours[1][label] == colours[0][label] for label in colours[1])
    assert len(set(colours[0].values())) == 3
    # With an adaptive row, a third panel: the widths it chose against the load, in its colour.
    rows += [{"label": "eagle K=2 adaptive", "load": load, "output_tok_s": 6.0, "tpot_mean_ms": 1.5,
              "adaptive": True, "mean_verified_width": width} for load, width in ((1, 2.0), (64, 0.5))]
    bench_serve.plot(rows, tmp_path / "plot.png", "requests in flight")
    left, _, widths = figures[1].axes
    lines = {line.get_label(): (list(line.get_ydata()), line.get_color()) for line in widths.get_lines()}
    colour = {line.get_label(): line.get_color() for line in left.get_lines()}["eagle K=2 adaptive"]
    figures[1].clear()
    assert lines == {"eagle K=2 adaptive": ([2.0, 0.5], colour)}  # rows without the figure are not drawn


def test_bench_serve_reports_the_drafts_verified_a_step_from_either_metrics_names():
    from specjax.bench_serve import Record, summarize

    engine = {"steps": 4, "drafted": 6, "accepted": 3}  # the engine's names; the server's are vLLM's
    server = {"num_spec_steps": 4, "num_draft_tokens": 10, "num_accepted_draft_tokens": 5}
    records = [Record(0.0, 0.1, 0.5, 5, (0.1, 0.5), metrics) for metrics in (engine, server)]
    point = summarize(records, wall=0.5)
    assert point["mean_verified_width"] == pytest.approx(16 / 8)
    assert point["mean_acceptance_length"] == pytest.approx(1 + 8 / 8)
    assert summarize(records[:1] + [dataclasses.replace(records[0], metrics=None)], 0.5)["mean_verified_width"] == 1.5


def test_bench_serve_predicts_an_adaptive_step_from_the_profiled_curve_of_the_loads_count():
    from specjax.bench_serve import predicted_step_ms

    profiled = {count: {"widths": [0, 2, 4], "seconds": [s * count for s in (0.001, 0.002, 0.004)], "source": "H100"}
                for count in (1, 16)}
    metrics = [{"per_step_drafted": [4, 4, 2]}, {"per_step_drafted": [0]}, {}]  # the last request took no step
    # 4 requests in flight step 16 slots: widths 4, 4, 2 and 0 cost 16 x 4, 4, 2 and 1 ms; 4 request-steps.
    assert predicted_step_ms(profiled, metrics, 4) == pytest.approx(16 * (4 + 4 + 2 + 1) / 4)
    assert predicted_step_ms(profiled, metrics, 1) == pytest.approx((4 + 4 + 2 + 1) / 4)
    assert predicted_step_ms(profiled, metrics, 64) == pytest.approx(16 * 2.75)  # past the counts: the largest
    assert predicted_step_ms(profiled, metrics, None) is None  # an open loop steps no one count
    assert predicted_step_ms({1: dict(profiled[1], source="analytic")}, metrics, 1) is None  # not seconds
    assert predicted_step_ms({}, metrics, 1) is None and predicted_step_ms(profiled, [{}], 1) is None


class _VisitEngine:
    """A stand-in for the engine's host side (bench_serve.run_point's use of it): each step() is one visit of
    `visit_s` that gives every request added before it its whole output, first token at the visit's end."""

    def __init__(self, visit_s: float):
        self.visit_s, self.added, self.outputs = visit_s, [], []
        self.steps_run = self.visits = 0
        self.device_wait_s = self.prefill_wait_s = self.step_s = 0.0

    def stats(self):
        return {"prefix_cache": None, "draft_kv_offload": None, "prefill_calls": self.visits, "prefill_padded_rows": 0}

    def add_request(self, request):
        self.added.append((request, time.perf_counter()))

    def has_work(self):
        return bool(self.added)

    def step(self):
        from specjax.engine import RequestOutput

        time.sleep(self.visit_s)
        now, self.visits, self.steps_run = time.perf_counter(), self.visits + 1, self.steps_run + 1
        out = [RequestOutput(request_id=r.request_id, tokens=(1, 2), finish_reason="length", arrival_time=added,
                             first_token_time=now, finish_time=now, token_times=(now, now)) for r, added in self.added]
        self.added = []
        self.outputs += out
        return out


def test_bench_serve_steady_throughput_is_the_saturated_rate_between_the_middle_ends():
    from specjax.bench_serve import Record, steady_throughput, summarize

    # Visits every 0.1 s. Request r arrives before visit r // 10 + 1 and gets 10 tokens at each of the next 10 visits:
    # at saturation (visits 10 to 40) 100 requests run, 1,000 tokens a visit, 10,000 tok/s; the ramp and the drain
    # (the first and last second) hold fewer. The 100th and 300th ends are at 2.0 and 3.9 s, inside saturation.
    records = []
    for r in range(400):
        visits = [0.1 * (r // 10 + v) for v in range(1, 11)]
        records.append(Record(0.1 * (r // 10), visits[0], visits[-1], 100, tuple(t for t in visits for _ in range(10)),
                              None))
    point = summarize(records, wall=max(r.finish for r in records))
    assert point["steady_tok_s"] == pytest.approx(10_000, rel=1e-6)
    assert point["output_tok_s"] == pytest.approx(40_000 / 4.9)  # the wall's rate holds the ramp and the drain
    # Ten requests end at each visit: counting the requests that end inside the window instead of the tokens
    # delivered there would give 199 requests' tokens over 19 visits' time, 10,474.
    chunked = [dataclasses.replace(r, token_times=tuple(sorted(set(r.token_times)))) for r in records]
    assert steady_throughput(chunked) == pytest.approx(10_000, rel=1e-6)  # a chunk a visit, as over HTTP
    assert steady_throughput(records[:3]) is None  # too few ends for a middle half


def test_bench_serve_open_loop_times_a_request_from_its_arrival_not_from_the_visit_that_admits_it():
    # In process the driver adds an arrival when the visit running then ends; over HTTP a client's clock starts when
    # it sends. Before, the in-process TTFT ran from the add (the engine's arrival_time) and missed that wait.
    from specjax.bench_serve import run_point

    engine = _VisitEngine(visit_s=0.2)
    point = run_point(engine, [[1, 2, 3]], num_requests=6, new_tokens=2, concurrency=None, rate=20.0,
                      burstiness=1.0, seed=0)
    assert point["requests"] == 6 and engine.visits >= 2
    added_ttft = sum(o.ttft for o in engine.outputs) / 6 * 1e3  # from the add (one visit each): the old measure
    # The requests arriving during the first visit (seed 0: 50 ms apart on average) waited part of it before they
    # were added: from their arrival their TTFT is longer by that wait.
    assert point["ttft_mean_ms"] > added_ttft + 10
    assert point["ttft_mean_ms"] <= engine.visits * engine.visit_s * 1e3 + 200

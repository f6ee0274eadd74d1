"""Experiments: one run (autoregressive baseline and speculative decoding on the same prompts) and
sweeps over any config fields, resumable, with a table and plots.

    specjax run configs/....yaml            one RunConfig; prints its table
    specjax sweep configs/sweeps/....yaml   a SweepConfig: base RunConfig x grid; writes under output_dir

A sweep appends one JSON line per finished point to results.jsonl and skips points already there, so
a killed sweep re-run computes only what is missing. Timing fields differ between runs; everything
else about a point (acceptance statistics, outputs' agreement) is a function of its config.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from specjax import benchmarking, default_models, sharding
from specjax.config import ConfigError, DataConfig, MeshConfig, SamplingConfig, SpecConfig, load_yaml
from specjax.proposers import PROPOSERS, UnsupportedSpeculation, check_spec, proposer_class
from specjax.verify import verifier_name


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """target / drafter: folders (a draft model, EAGLE head or Medusa heads; none for ngram);
    `default:NAME` names a bundled model, and with target `default:target` the drafter defaults to the
    bundled one of spec.method.
    Prompts come from prompts_file (a JSON list of strings, or of token-id lists: prompts cut to an exact
    length) or, without one, from num_prompts windows of prompt_len tokens of the held-out split of `corpus`."""

    target: str
    drafter: str | None = None
    spec: SpecConfig = SpecConfig()
    sampling: SamplingConfig = SamplingConfig()
    prompts_file: str | None = None
    corpus: DataConfig = DataConfig()
    num_prompts: int = 16
    prompt_len: int = 64
    max_new_tokens: int = 64
    seed: int = 0
    # Compute dtype of target and drafter (None: the checkpoints'). float32 by default: in bfloat16 the
    # verify pass over K + 1 positions and the one-token autoregressive pass round differently, and
    # a near-tie in the logits can then flip a greedy token (how often: docs/performance.md).
    dtype: str | None = "float32"
    # Devices (specjax.sharding): None runs on one device; e.g. {data: 1, model: 2} splits the models.
    mesh: MeshConfig | None = None
    # FR-Spec for a drafter that takes a draft vocabulary (spec.method 'eagle' or 'dflash'): it drafts only
    # the draft_vocab_size ids most frequent in the training split of `corpus` (its first FREQUENCY_TOKENS
    # tokens); None: every id.
    draft_vocab_size: int | None = None

    def __post_init__(self):
        # What SpecConfig leaves to the registries (names, drafter options), checked now so that a file names its error.
        check_spec(self.spec)
        verifier_name(self.spec, self.sampling)
        takes = sorted(name for name, cls in PROPOSERS.items() if cls.takes_draft_vocabulary)
        if self.draft_vocab_size is not None and (self.spec.method not in takes or self.draft_vocab_size < 1):
            raise ConfigError(f"RunConfig.draft_vocab_size = {self.draft_vocab_size!r} is invalid with spec.method "
                              f"{self.spec.method!r}: allowed null, or a positive integer with methods {takes}")


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """grid: dotted RunConfig field paths (e.g. spec.num_speculative_tokens) to lists of values; a value
    that is a mapping for a config (e.g. spec: [{total_tokens: 16, tree_top_k: 4}]) sets its fields together."""

    base: RunConfig
    grid: dict[str, list[Any]]
    output_dir: str = "runs/sweep"


# ------------------------------------------------------------------------------------------ loading

def load_drafter(method: str, folder: str | None, target, dtype: str | None = None, model_shards: int = 1,
                 method_option: str = "spec.method"):
    """The drafter weights a method needs, from their folder (`default:NAME` for a bundled one), by the
    method's registered proposer (its `load`); None for a method without weights. dtype is the compute
    dtype (None: the checkpoint's); modules come in transformer.for_decoding for model_shards. A folder that
    does not exist, or that another method's proposer recognizes, is a ConfigError saying so (method_option:
    how the caller's user sets the method, named in it)."""
    proposer = proposer_class(method)
    if not proposer.needs_drafter:
        return None
    if folder is None:
        raise ConfigError(f"RunConfig.drafter is missing: method {method!r} needs a drafter folder")
    path = default_models.resolve(folder)
    if not path.is_dir():
        raise ConfigError(f"drafter folder {folder} does not exist")
    other = recognized_method(path)
    if other is not None and other != method and not proposer.recognizes(path):
        raise ConfigError(f"drafter folder {folder} holds {proposer_class(other).checkpoint_kind}, not "
                          f"{proposer.checkpoint_kind}: use {method_option} {other}")
    return proposer.load(path, target, dtype, model_shards)


def recognized_method(folder) -> str | None:
    """The registered method whose proposer recognizes a drafter folder by its files, None if none does."""
    return next((name for name, proposer in PROPOSERS.items() if proposer.recognizes(Path(folder))), None)


def default_drafter(target: str, method: str, drafter: str | None) -> str | None:
    """drafter; without one, for the bundled target, the method's bundled drafter (its proposer's
    `default_drafter`)."""
    if drafter is None and target == default_models.TARGET:
        return proposer_class(method).default_drafter
    return drafter


def drafter_folder(config: RunConfig) -> str | None:
    """config.drafter; for the bundled target without one, the bundled drafter of the method."""
    return default_drafter(config.target, config.spec.method, config.drafter)


def load_models(target: str, method: str | None = None, drafter: str | None = None, dtype: str | None = None,
                model_shards: int = 1):
    """(target model, its tokenizer, drafter) from folders, for research scripts; `default:NAME` names a
    bundled model, and with the bundled target the drafter defaults to the bundled one of the method;
    `shape:NAME` random weights at benchmarking.SHAPES' sizes (speed.shaped_models).
    dtype: the compute dtype of both (None: the checkpoints'). Models come in the layout that decodes
    fastest on the backend (transformer.for_decoding), for a mesh of model_shards on its model axis."""
    from specjax import speed
    from specjax.models import hf
    from specjax.models.transformer import for_decoding

    if target.startswith(speed.SHAPE_PREFIX):  # random weights at a released model's sizes
        return speed.shaped_models(target[len(speed.SHAPE_PREFIX):], method)
    model = for_decoding(hf.load(default_models.resolve(target), dtype=dtype), model_shards)
    tokenizer = load_tokenizer(target)
    if method is None:
        return model, tokenizer, None
    return model, tokenizer, load_drafter(method, default_drafter(target, method, drafter), model, dtype, model_shards)


def load_tokenizer(target: str):
    """The tokenizer load_models gives with the target, without loading any weights."""
    from transformers import AutoTokenizer

    from specjax import speed

    if target.startswith(speed.SHAPE_PREFIX):
        return speed.shaped_tokenizer(target[len(speed.SHAPE_PREFIX):])
    return AutoTokenizer.from_pretrained(default_models.tokenizer_folder(target))


FREQUENCY_TOKENS = 2_000_000  # enough to rank the ids of a code corpus (FR-Spec counts over a corpus sample too)


def training_sample(corpus: DataConfig, tokenizer) -> np.ndarray:
    """The first FREQUENCY_TOKENS tokens of the corpus' training split, whose counts rank FR-Spec's ids."""
    from specjax.data.corpus import read_texts
    from specjax.data.dataset import split_files

    _, train, _ = split_files(corpus)
    ids: list[int] = []
    for text in read_texts(train):
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) >= FREQUENCY_TOKENS:
            break
    return np.asarray(ids[:FREQUENCY_TOKENS])


def load_prompts(config: RunConfig, tokenizer) -> list[list[int]]:
    if config.prompts_file:
        prompts = json.loads(Path(config.prompts_file).read_text())
        if isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts):
            return [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        vocab = len(tokenizer)
        if not (isinstance(prompts, list) and prompts and all(
                isinstance(p, list) and p and all(isinstance(i, int) and 0 <= i < vocab for i in p) for p in prompts)):
            raise ConfigError(f"RunConfig.prompts_file = {config.prompts_file!r}: allowed a non-empty JSON list of "
                              f"prompt strings, or of non-empty lists of token ids in [0, {vocab})")
        return prompts
    from specjax.data.corpus import read_texts
    from specjax.data.dataset import split_files
    from specjax.training.evaluation import held_out_prompts

    _, _, held_out = split_files(config.corpus)
    ids: list[int] = []
    for text in read_texts(held_out):
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) > config.num_prompts * config.prompt_len * 4:
            break
    return held_out_prompts(np.asarray(ids), config.num_prompts, config.prompt_len, config.seed)


# ---------------------------------------------------------------------------------------------- run

class Runner:
    """Runs configs that share a target and prompts, caching loaded models and baselines."""

    def __init__(self):
        self._models: dict = {}
        self._baselines: dict = {}
        self._samples: dict = {}  # (target, corpus) -> training_sample, tokenized once for every draft_vocab_size

    def _target(self, folder: str, dtype: str | None, model_shards: int):
        if (folder, dtype, model_shards) not in self._models:
            self._models[folder, dtype, model_shards] = load_models(folder, dtype=dtype, model_shards=model_shards)[:2]
        return self._models[folder, dtype, model_shards]

    @staticmethod
    def _timed(precision: str | None, **kwargs):
        from specjax.decoding import generate

        with jax.default_matmul_precision(precision):
            generate(**kwargs)  # compile
            start = time.perf_counter()
            result = generate(**kwargs)
        return result, time.perf_counter() - start

    def run(self, config: RunConfig) -> dict:
        model_shards = 1 if config.mesh is None else config.mesh.model
        target, tokenizer = self._target(config.target, config.dtype, model_shards)
        prompts = load_prompts(config, tokenizer)
        mesh = None if config.mesh is None else sharding.make_mesh(config.mesh.data, config.mesh.model)
        common = dict(model=target, prompts=prompts, max_new_tokens=config.max_new_tokens,
                      sampling=config.sampling, seeds=list(range(len(prompts))), mesh=mesh)
        baseline_key = (config.target, config.dtype, json.dumps(prompts), config.max_new_tokens, config.sampling,
                        config.mesh)
        # float32 runs multiply in float32: GPUs otherwise take float32 products in TF32, whose rounding
        # flips greedy near-ties between the verify pass and the one-token pass (docs/performance.md).
        precision = "float32" if config.dtype == "float32" else None
        if baseline_key not in self._baselines:
            self._baselines[baseline_key] = self._timed(precision, **common)
        baseline, ar_seconds = self._baselines[baseline_key]
        drafter_key = (config.spec.method, drafter_folder(config), config.dtype, model_shards)
        if drafter_key not in self._models:
            self._models[drafter_key] = load_drafter(*drafter_key[:2], target, config.dtype, model_shards)
        drafter = self._models[drafter_key]
        if config.draft_vocab_size is not None:
            from specjax.models.vocabulary import draft_vocabulary

            sample_key = (config.target, config.corpus)
            if sample_key not in self._samples:
                self._samples[sample_key] = training_sample(config.corpus, tokenizer)
            vocab = target.config.vocab_size
            ids = draft_vocabulary(self._samples[sample_key], vocab, min(config.draft_vocab_size, vocab))
            drafter = proposer_class(config.spec.method).with_draft_vocabulary(drafter, ids)
        spec, choice = config.spec, None
        if spec.total_tokens == "auto":  # chosen once, untimed; the chosen size is timed
            from specjax.decoding import generate

            with jax.default_matmul_precision(precision):
                choice = generate(**common, spec=spec, drafter=drafter).tree_size_choice
            spec = dataclasses.replace(spec, total_tokens=choice.total_tokens)
        result, spec_seconds = self._timed(precision, **common, spec=spec, drafter=drafter)
        summary = result.metrics.summary()
        greedy = config.sampling.is_greedy
        return {
            **point_fields(config),
            **proposer_class(config.spec.method).describe(config.spec, drafter),
            **({} if choice is None else {"tree_nodes": choice.total_tokens, "tree_size_auto": {
                "sizes": choice.sizes, "estimated_acceptance": choice.acceptance, "verify_s": choice.verify_s,
                "rest_s": choice.rest_s, "predicted_tokens_per_s": choice.predicted_tok_s}}),
            "mean_acceptance_length": summary["mean_acceptance_length"],
            "acceptance_rate": summary["acceptance_rate"],
            "per_position_acceptance": summary["per_position_acceptance"],
            # Drafts verified a step: K, or what adaptive verification chose on average.
            "mean_verified_width": summary["drafted"] / summary["steps"] if summary["steps"] else None,
            # A batch's loop runs until its slowest row ends: its steps against a row's mean bound the speedup
            # at a batch beyond what acceptance says (a continuous-batching engine refills the early-ended rows).
            "loop_steps": int(result.metrics.steps.max()) if result.metrics.steps.size else 0,
            "mean_row_steps": float(result.metrics.steps.mean()) if result.metrics.steps.size else 0.0,
            "ar_tokens_per_s": float(baseline.num_generated.sum()) / ar_seconds,
            "spec_tokens_per_s": float(result.num_generated.sum()) / spec_seconds,
            "speedup": ar_seconds / spec_seconds * float(result.num_generated.sum()) / float(
                baseline.num_generated.sum()),
            # Rows whose speculative tokens equal the autoregressive ones (greedy runs only).
            "greedy_identical_rows": sum(a == b for a, b in zip(result.sequences(), baseline.sequences(), strict=True))
            if greedy else None,
            "prompts": len(prompts), "device": jax.devices()[0].device_kind, "devices": 1 if mesh is None else mesh.size,
            "jax": jax.__version__,
        }


def point_fields(config: RunConfig) -> dict:
    """What names a run in tables and plots."""
    return {"method": config.spec.method, "K": config.spec.num_speculative_tokens,
            "rejection_sample_method": config.spec.rejection_sample_method,
            "draft_sample_method": config.spec.draft_sample_method, "temperature": config.sampling.temperature,
            "draft_vocab_size": config.draft_vocab_size,
            "tree_nodes": config.spec.num_draft_nodes if config.spec.drafts_tree else None,
            "tree_top_k": config.spec.tree_top_k, "dflash_full_block": config.spec.dflash_full_block or None,
            "adaptive": config.spec.enable_adaptive_verification or None}


def drafter_name(row: dict) -> str:
    """The method, with its draft vocabulary's size (FR-Spec), its draft tree's nodes, DFlash's full block
    and the number of MTP modules when set."""
    size, nodes, top_k = row.get("draft_vocab_size"), row.get("tree_nodes"), row.get("tree_top_k")
    auto = "auto: " if row.get("tree_size_auto") else ""
    tree = "" if nodes is None else f" ({auto}{nodes}-node tree{'' if top_k is None else f', top-{top_k}'})"
    full_block = " (full block)" if row.get("dflash_full_block") else ""
    modules = "" if row.get("mtp_modules") is None else f" ({row['mtp_modules']} module{'s' * (row['mtp_modules'] > 1)})"
    adaptive = " (adaptive)" if row.get("adaptive") else ""
    return "".join([row["method"], "" if size is None else f" ({size} ids)", tree, full_block, modules, adaptive])


TIMING_FIELDS = ("ar_tokens_per_s", "spec_tokens_per_s", "speedup", "device", "devices", "jax")
TABLE = [("method", "method"), ("K", "K"), ("rejection_sample_method", "verifier"), ("temperature", "T"),
         ("draft_sample_method", "drafting"), ("mean_acceptance_length", "mean acc. length"),
         ("acceptance_rate", "acc. rate"), ("ar_tokens_per_s", "AR tokens/s"), ("spec_tokens_per_s", "tokens/s"),
         ("speedup", "speedup"), ("greedy_identical_rows", "rows = AR")]
# Parameters of the bundled target (specjax/default_models/MODEL_CARD.md): the footer's reason for speedups below 1.
BUNDLED_TARGET_PARAMETERS = "12.6M"


def verifier_label(row: dict) -> str:
    """The verifier that ran: at temperature 0 every lossless choice runs the greedy one (SpecConfig's docstring)."""
    method = row["rejection_sample_method"]
    return "greedy" if row["temperature"] == 0 and method != "synthetic" else method


def markdown(rows: list[dict]) -> str:
    """The table of the runs, with a footer saying what its columns mean; points a drafter cannot run are
    listed under it."""
    lines = ["| " + " | ".join(h for _, h in TABLE) + " |", "|" + "---|" * len(TABLE)]
    skipped = [row for row in rows if "skipped" in row]
    ran = [row for row in rows if "skipped" not in row]
    for row in ran:
        cells = []
        for key, _ in TABLE:
            value = {"method": drafter_name(row), "rejection_sample_method": verifier_label(row)}.get(key, row.get(key))
            if key == "greedy_identical_rows" and value is not None:
                value = f"{value}/{row['prompts']}"
            cells.append(f"{value:.3g}" if isinstance(value, float) else ("" if value is None else str(value)))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *footer(ran)]
    if skipped:
        lines += ["", f"Skipped {len(skipped)} points the drafter cannot run:"]
        lines += [f"- {row['method']} K={row['K']} {row['rejection_sample_method']} T={row['temperature']:g}: "
                  f"{row['skipped']}" for row in skipped]
    return "\n".join(lines) + "\n"


def footer(rows: list[dict]) -> list[str]:
    """What the table's columns mean, and why speedups are below 1 where they are."""
    notes = ["mean acc. length: tokens committed per target forward (accepted drafts + 1); acc. rate: accepted / "
             "drafted. speedup: tokens/s over the autoregressive tokens/s (AR tokens/s) on the same prompts."]
    if any(row.get("greedy_identical_rows") is not None for row in rows):
        notes.append("rows = AR: greedy rows whose speculative output equals the autoregressive output token for "
                     "token (lossless decoding: all of them; in bfloat16 or TF32 a near-tie may flip one, "
                     "docs/performance.md \"Rounding\").")
    slow = sorted({row.get("device", "?") for row in rows if row.get("speedup", 1) < 1})
    if slow:
        notes.append(f"Speedups below 1 ({', '.join(slow)}): small models (the bundled target has "
                     f"{BUNDLED_TARGET_PARAMETERS} parameters) are bound by kernel launches and dispatch, not by "
                     "reading weights, so the drafter's and the K + 1-token verify's extra work is not hidden; "
                     "speculation pays where decoding is memory bound: `specjax speed` on a GPU (Llama-3.1-8B "
                     "shapes; docs/performance.md has measured speedups).")
    return notes


# -------------------------------------------------------------------------------------------- sweep

def replace_path(config, path: str, value, full_path: str | None = None):
    """config with the dotted field path set to value (validated as the file's values are)."""
    head, _, rest = path.partition(".")
    names = {f.name for f in dataclasses.fields(config)}
    if head not in names:
        raise ConfigError(f"grid key {full_path or path!r}: {type(config).__name__} has no field {head!r}: "
                          f"allowed {sorted(names)}")
    if rest:
        inner = replace_path(getattr(config, head), rest, value, full_path or path)
        return dataclasses.replace(config, **{head: inner})
    current = getattr(config, head)
    if isinstance(value, dict) and dataclasses.is_dataclass(current):
        # Fields that are only valid together (e.g. a dynamic tree's total_tokens and top_k) set at once.
        fields = {f.name for f in dataclasses.fields(current)}
        for key in value:
            if key not in fields:
                raise ConfigError(f"grid key {full_path or path!r}: {type(current).__name__} has no field {key!r}: "
                                  f"allowed {sorted(fields)}")
        return dataclasses.replace(config, **{head: dataclasses.replace(current, **value)})
    return dataclasses.replace(config, **{head: value})


def grid_points(sweep: SweepConfig) -> list[tuple[dict, RunConfig]]:
    keys = sorted(sweep.grid)
    points = []
    for values in itertools.product(*(sweep.grid[k] for k in keys)):
        assignment = dict(zip(keys, values))
        config = sweep.base
        for key, value in assignment.items():
            config = replace_path(config, key, value)
        points.append((assignment, config))
    return points


def point_id(assignment: dict) -> str:
    return json.dumps(assignment, sort_keys=True)


def run_sweep(sweep: SweepConfig, runner: Runner | None = None) -> list[dict]:
    """Runs the grid points not yet in output_dir/results.jsonl; writes results.csv, results.md and plots."""
    out = Path(sweep.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    done = {}
    if results_path.exists():
        for line in results_path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                done[record["point"]] = record
    points = grid_points(sweep)
    runner = runner or Runner()
    missing = [(a, c) for a, c in points if point_id(a) not in done]
    with results_path.open("a") as log:
        for assignment, config in tqdm(missing, total=len(points), initial=len(points) - len(missing), desc="sweep",
                                       unit="point"):
            try:
                result = runner.run(config)
            except UnsupportedSpeculation as error:  # e.g. K above Medusa's heads: recorded, not retried
                result = {**point_fields(config), "skipped": str(error)}
            record = {"point": point_id(assignment), **result}
            log.write(json.dumps(record) + "\n")
            log.flush()
            done[record["point"]] = record
    rows = [done[point_id(a)] for a, _ in points]
    write_tables(rows, out)
    plot(rows, out)
    return rows


def write_tables(rows: list[dict], out: Path) -> None:
    fields = list(dict.fromkeys(k for row in rows for k in row if k != "per_position_acceptance"))
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields + ["per_position_acceptance"])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "per_position_acceptance": " ".join(
                f"{p:.3f}" for p in row.get("per_position_acceptance", []))})
    (out / "results.md").write_text(markdown(rows))


def plot(rows: list[dict], out: Path) -> None:
    """Mean acceptance length and speedup against K, one panel per temperature, a line per (method,
    verifier); per-position acceptance at each series' largest K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [row for row in rows if "skipped" not in row]
    temperatures = sorted({row["temperature"] for row in rows})
    methods = sorted({drafter_name(row) for row in rows})
    # A colormap called with an index past its colours returns its last: more than 10 drafters take tab20's 20, and
    # past those the markers tell them apart.
    palette = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    colors = {method: palette(i % palette.N) for i, method in enumerate(methods)}
    markers = {method: "osD^v"[i // palette.N % 5] for i, method in enumerate(methods)}
    styles = {"standard": "-", "block": "--", "greedy": "-", "synthetic": ":"}
    series: dict[tuple, list[dict]] = {}
    for row in rows:
        series.setdefault((row["temperature"], drafter_name(row), verifier_label(row)), []).append(row)

    ks = sorted({row["K"] for row in rows})

    def figure(ylabel: str, name: str, draw, reference: float | None = None) -> None:
        fig, axes = plt.subplots(1, len(temperatures), figsize=(5.5 * len(temperatures), 4.2), squeeze=False,
                                 sharey=True)
        for ax, temperature in zip(axes[0], temperatures):
            for (t, method, verifier), points in sorted(series.items()):
                if t == temperature:
                    draw(ax, sorted(points, key=lambda r: r["K"]), dict(
                        color=colors[method], linestyle=styles.get(verifier, "-"), marker=markers[method], markersize=3,
                        label=f"{method}, {verifier}"))
            ax.set_title(f"T = {temperature:g}")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if reference is not None:
                ax.axhline(reference, color="gray", linewidth=0.8, linestyle="--", label="autoregressive")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        benchmarking.save_figure(fig, out / name)
        plt.close(fig)

    def bars(key: str, ylabel: str, name: str, reference: float | None) -> None:
        """One K: a bar per (method, verifier) in each temperature's panel, its value written on it."""
        fig, axes = plt.subplots(1, len(temperatures), figsize=(max(5.5, 1.1 * len(series)) * len(temperatures), 4.6),
                                 squeeze=False, sharey=True)
        for ax, temperature in zip(axes[0], temperatures):
            shown = [(method, verifier, points[0]) for (t, method, verifier), points in sorted(series.items())
                     if t == temperature]
            drawn = ax.bar(range(len(shown)), [row[key] for _, _, row in shown],
                           color=[colors[method] for method, _, _ in shown])
            ax.bar_label(drawn, fmt="%.2f", fontsize=8)
            ax.set_xticks(range(len(shown)), [f"{method}\n{verifier}" for method, verifier, _ in shown], fontsize=8,
                          rotation=30, ha="right")
            if reference is not None:
                ax.axhline(reference, color="gray", linewidth=0.8, linestyle="--", label="autoregressive")
                ax.legend(fontsize=7)
            ax.set_title(f"T = {temperature:g}, K = {ks[0]}")
            ax.grid(alpha=0.3, axis="y")
        axes[0][0].set_ylabel(ylabel)
        fig.tight_layout()
        benchmarking.save_figure(fig, out / name)
        plt.close(fig)

    for key, ylabel, name, reference in (
            ("mean_acceptance_length", "mean acceptance length", "acceptance_vs_k.png", None),
            ("speedup", "speedup over autoregressive", "speedup_vs_k.png", 1.0)):
        def against_k(ax, points, style, key=key):
            ax.plot([p["K"] for p in points], [p[key] for p in points], **style)
            ax.set_xlabel("num_speculative_tokens (K)")
            if len(ks) <= 16:  # every K of the grid a tick, and no others
                ax.set_xticks(ks)
        if len(ks) == 1:
            bars(key, ylabel, name, reference)
        else:
            figure(ylabel, name, against_k, reference)

    def per_position(ax, points, style):
        widest = points[-1]
        ax.plot(range(1, widest["K"] + 1), widest["per_position_acceptance"], **style)
        ax.set_xlabel("draft position (at the largest K)")
    figure("fraction of steps accepting it", "per_position_acceptance.png", per_position)
    if any(row.get("tree_nodes") for row in rows):
        plot_tree_sizes(rows, temperatures, out, plt)


def plot_tree_sizes(rows: list[dict], temperatures: list[float], out: Path, plt) -> None:
    """Mean acceptance length against the drafts scored a step (a chain's K, a tree's nodes), a line per
    (method, verifier, depth K, and a dynamic tree's top-k): trees against the chain of their depth,
    which starts every line of its method."""
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5.5 * len(temperatures), 4.2), squeeze=False, sharey=True)
    for ax, temperature in zip(axes[0], temperatures):
        chains: dict[tuple, dict] = {}
        lines: dict[tuple, list[dict]] = {}
        batches = len({row.get("prompts") for row in rows}) > 1  # a line per batch size too
        autos = [row for row in rows if row["temperature"] == temperature and row.get("tree_size_auto")]
        if autos:  # stars at the sizes total_tokens 'auto' picked
            ax.plot([r["tree_nodes"] for r in autos], [r["mean_acceptance_length"] for r in autos], marker="*",
                    markersize=12, linestyle="none", color="black", label="total_tokens auto's picks")
        for row in rows:
            if row["temperature"] == temperature and not row.get("tree_size_auto"):
                key = (row["method"], row["rejection_sample_method"], row["K"], *([row.get("prompts")] if batches else []))
                if row.get("tree_nodes") is None:
                    chains[key] = row
                else:
                    lines.setdefault((*key, row.get("tree_top_k") or 0), []).append(row)
        for (*key, top_k), points in sorted(lines.items()):
            points = sorted(points, key=lambda r: r["tree_nodes"])
            points = ([chains[tuple(key)]] if tuple(key) in chains else []) + points
            method, verifier, k, *prompts = key
            ax.plot([p.get("tree_nodes") or p["K"] for p in points], [p["mean_acceptance_length"] for p in points],
                    marker="o", label=f"{method}, {verifier}, depth {k}" + (f", top-{top_k}" if top_k else "")
                    + (f", {prompts[0]} prompts" if prompts else ""))
        ax.set_title(f"T = {temperature:g}")
        ax.set_xlabel("drafts scored a step (chain: K; tree: nodes)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean acceptance length")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    benchmarking.save_figure(fig, out / "acceptance_vs_tree_size.png")
    plt.close(fig)


def load_run(path, overrides=()) -> RunConfig:
    return load_yaml(RunConfig, path, overrides)


def load_sweep(path, overrides=()) -> SweepConfig:
    """A sweep whose every grid point is a valid RunConfig (checked now, naming the file)."""
    sweep = load_yaml(SweepConfig, path, overrides)
    try:
        grid_points(sweep)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from error
    return sweep

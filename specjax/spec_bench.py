"""A Spec-Bench-style table on a code target: mean acceptance length and speedup of every trained drafter
(chains at several K, EAGLE-2 dynamic trees, DFlash's block) at T 0 and 1, per category of prompt.

Spec-Bench (Xia et al., 2024) reports speculative methods per task (translation, summarization, QA, math, RAG,
...). A code corpus has its own kinds of prompt, cut from files the target never trained on:

- ``held_out``: windows of held-out files at evenly spread offsets (what the K sweeps measure);
- ``function_body``: a held-out function up to the end of its docstring (or signature): the model writes the body;
- ``docstring``: a held-out function up to its docstring's opening quotes: the model writes prose;
- ``tests``: windows of the corpus' test files, which training excludes (`data.corpus.source_files`);
- ``long_context``: held-out windows of ``long_prompt_len`` tokens.

Every prompt of a category is cut to the same number of tokens (its last ones), so a category's points share
their compiled programs. The drafters are the runs of ``scripts/train_default_models.sh`` (``RECIPE=code``):
each stage's model folder is the one holding its ``eval.json``. Points run through `specjax.experiments`'
sweeps (one output folder per category and drafter, resumable), then one table and one plot gather them:

    PYTHONPATH=. python -m specjax.spec_bench --runs runs/code --corpus-dir SITE_PACKAGES --out OUT
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from specjax.config import DataConfig, SpecConfig
from specjax.data.corpus import read_texts, source_files
from specjax.data.dataset import split_files
from specjax.experiments import RunConfig, Runner, SweepConfig, drafter_name, load_tokenizer, run_sweep
from specjax.training.evaluation import held_out_prompts

CATEGORIES = ("held_out", "function_body", "docstring", "tests", "long_context")

# What each trained stage is drafted as: (stage folder, method, the spec points of its chain and trees). The chain at
# K 6 is the trees' peer (EAGLE-2 trees of depth 6, as configs/sweeps/eagle_tree.yaml); K 5 is the issue's EAGLE
# comparison; DFlash and DSpark draft their whole block of 16 at K 15 and a K 7 prefix of it.
EAGLE_POINTS = ({"num_speculative_tokens": 5}, {"num_speculative_tokens": 6},
                {"num_speculative_tokens": 6, "total_tokens": 32, "tree_top_k": 4},
                {"num_speculative_tokens": 6, "total_tokens": 60, "tree_top_k": 8})
DRAFTERS = (
    ("eagle1", "eagle", EAGLE_POINTS),
    ("eagle3", "eagle3", EAGLE_POINTS),
    ("medusa", "medusa", ({"num_speculative_tokens": 4},)),
    ("dflash", "dflash", ({"num_speculative_tokens": 7}, {"num_speculative_tokens": 15})),
    ("dspark", "dspark", ({"num_speculative_tokens": 7}, {"num_speculative_tokens": 15})),
    ("mtp", "mtp", ({"num_speculative_tokens": 3},)),
    ("mtp3", "mtp", ({"num_speculative_tokens": 3},)),
)


@dataclasses.dataclass(frozen=True)
class FunctionCut:
    """Byte offsets into a file where a function's docstring opens (after its quotes; None without a
    triple-quoted docstring) and where its body's code begins (the start of the line after the docstring)."""

    docstring: int | None
    body: int


def function_cuts(source: str) -> list[FunctionCut]:
    """Every function with code after its docstring (or a body of two statements or more without one), in
    file order; [] for a file that does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    data = source.encode()
    line_starts = np.concatenate([[0], np.flatnonzero(np.frombuffer(data, np.uint8) == ord("\n")) + 1])
    cuts = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        first = node.body[0]
        has_docstring = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                         and isinstance(first.value.value, str))
        docstring = None
        if has_docstring:  # ast's col_offset counts UTF-8 bytes
            start = int(line_starts[first.lineno - 1]) + first.col_offset
            if data[start:start + 3] in (b'"""', b"'''"):
                docstring = start + 3
        code = node.body[1] if has_docstring else node.body[0]
        cuts.append(FunctionCut(docstring, int(line_starts[code.lineno - 1])))
    return sorted(cuts, key=lambda cut: cut.body)


def _last_tokens(tokenizer, text: str, length: int) -> list[int] | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[-length:] if len(ids) >= length else None


def _function_prompts(files: list[Path], tokenizer, kind: str, count: int, length: int, seed: int,
                      per_file: int = 2) -> list[list[int]]:
    """count prompts cut at functions of the files (visited in a seeded order, at most per_file a file): the
    text before the cut, its last `length` tokens."""
    order = np.random.default_rng([seed, 1]).permutation(len(files))
    prompts: list[list[int]] = []
    for index in order:
        source = files[index].read_text(encoding="utf-8", errors="replace")
        data = source.encode()
        offsets = [cut.body if kind == "function_body" else cut.docstring for cut in function_cuts(source)]
        offsets = [o for o in offsets if o is not None]
        picked = np.random.default_rng([seed, 2, int(index)]).permutation(len(offsets))[:per_file]
        for o in sorted(offsets[i] for i in picked):
            prompt = _last_tokens(tokenizer, data[:o].decode(errors="replace"), length)
            if prompt is not None:
                prompts.append(prompt)
        if len(prompts) >= count:
            return prompts[:count]
    raise ValueError(f"{len(files)} held-out files gave {len(prompts)} {kind} prompts of {length} tokens, fewer than "
                     f"{count}: use fewer prompts, shorter ones or more files")


def _window_prompts(files: list[Path], tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """count windows of `length` tokens at spread offsets of the files' text (enough files, read in order)."""
    ids: list[int] = []
    for text in read_texts(files):
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) > count * length * 4:
            break
    return held_out_prompts(np.asarray(ids), count, length, seed)


def category_prompts(corpus: DataConfig, tokenizer, *, num_prompts: int, prompt_len: int, long_prompt_len: int,
                     seed: int = 0) -> dict[str, list[list[int]]]:
    """Each category's prompts as token ids (module docstring); the held-out split is the target's (corpus)."""
    root, _, held_out = split_files(corpus)
    trained = set(source_files(root, corpus.pattern))
    tests = [f for f in source_files(root, corpus.pattern, exclude_tests=False) if f not in trained]
    if not tests:
        raise ValueError(f"no test files under {root} (folders named test, tests or idle_test) for the tests category")
    tests = [tests[i] for i in np.random.default_rng([seed, 3]).permutation(len(tests))]
    held_out = [held_out[i] for i in np.random.default_rng([seed, 4]).permutation(len(held_out))]
    return {
        "held_out": _window_prompts(held_out, tokenizer, num_prompts, prompt_len, seed),
        "function_body": _function_prompts(held_out, tokenizer, "function_body", num_prompts, prompt_len, seed),
        "docstring": _function_prompts(held_out, tokenizer, "docstring", num_prompts, prompt_len, seed),
        "tests": _window_prompts(tests, tokenizer, num_prompts, prompt_len, seed),
        "long_context": _window_prompts(held_out, tokenizer, num_prompts, long_prompt_len, seed),
    }


def trained_drafters(runs: Path, stages: list[str] | None = None) -> list[tuple[str, str, Path, tuple]]:
    """(stage, method, model folder, spec points) of every stage of DRAFTERS (those named in stages, if given)
    that finished under runs."""
    known = [stage for stage, _, _ in DRAFTERS]
    if stages is not None and set(stages) - set(known):
        raise SystemExit(f"--drafters {','.join(stages)}: allowed stages {known}")
    found = []
    for stage, method, points in DRAFTERS:
        done = sorted((runs / stage).glob("*/eval.json")) if stages is None or stage in stages else []
        if done:
            found.append((stage, method, done[0].parent, points))
    return found


def table(rows: list[dict]) -> str:
    """Mean acceptance length (speedup) per drafter point and temperature, a column per category."""
    categories = [c for c in CATEGORIES if any(row["category"] == c for row in rows)]
    keys = list(dict.fromkeys((row["stage"], drafter_name(row), row["K"], row["temperature"]) for row in rows))
    lines = ["| drafter | run | K | T | " + " | ".join(categories) + " | rows = AR |",
             "|---|---|---|---|" + "---|" * len(categories) + "---|"]
    for stage, name, k, temperature in keys:
        cells, identical = [], []
        for category in categories:
            row = next((r for r in rows if (r["stage"], drafter_name(r), r["K"], r["temperature"], r["category"])
                        == (stage, name, k, temperature, category)), None)
            if row is None or "skipped" in row:
                cells.append("")
                continue
            cells.append(f"{row['mean_acceptance_length']:.2f} ({row['speedup']:.2f}x)")
            if row.get("greedy_identical_rows") is not None:
                identical.append(f"{row['greedy_identical_rows']}/{row['prompts']}")
        lines.append(f"| {name} | {stage} | {k} | {temperature:g} | " + " | ".join(cells)
                     + f" | {', '.join(dict.fromkeys(identical)) or '-'} |")
    return "\n".join(lines) + "\n"


def headline(rows: list[dict]) -> list[str]:
    """Issue 41's comparisons at T 0, per category where both sides ran: EAGLE-3 against EAGLE-1 at K 5, each
    EAGLE-2 tree against its chain at the same depth, DFlash and DSpark at K 15."""
    def length(stage, k, nodes=None, category="held_out"):
        row = next((r for r in rows if r["stage"] == stage and r["K"] == k and r["temperature"] == 0
                    and r.get("tree_nodes") == nodes and r["category"] == category and "skipped" not in r), None)
        return None if row is None else row["mean_acceptance_length"]

    lines = []
    for category in CATEGORIES:
        found = []
        e1, e3 = length("eagle1", 5, category=category), length("eagle3", 5, category=category)
        if e1 and e3:
            found.append(f"EAGLE-3 {e3:.2f} against EAGLE-1 {e1:.2f} at K 5 ({e3 / e1:.2f}x)")
        for stage in ("eagle1", "eagle3"):
            chain = length(stage, 6, category=category)
            for nodes in (32, 60):
                tree = length(stage, 6, nodes, category)
                if chain and tree:
                    found.append(f"{stage} {nodes}-node tree {tree / chain:.2f}x its K 6 chain")
        dflash, dspark = length("dflash", 15, category=category), length("dspark", 15, category=category)
        if dflash:
            found.append(f"DFlash {dflash:.2f} at K 15")
        if dspark:
            found.append(f"DSpark {dspark:.2f} at K 15" + (f" ({dspark / dflash:.2f}x DFlash)" if dflash else ""))
        if found:
            lines.append(f"- {category}: " + "; ".join(found) + ".")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    """Mean acceptance length per category, a bar per drafter point, one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specjax import benchmarking

    rows = [row for row in rows if "skipped" not in row]
    temperatures = sorted({row["temperature"] for row in rows})
    categories = [c for c in CATEGORIES if any(row["category"] == c for row in rows)]
    fig, axes = plt.subplots(1, len(temperatures), figsize=(7 * len(temperatures), 4.5), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        points = list(dict.fromkeys((row["stage"], drafter_name(row), row["K"]) for row in rows
                                    if row["temperature"] == temperature))
        width = 0.8 / max(1, len(points))
        for i, (stage, name, k) in enumerate(points):
            values = [next((r["mean_acceptance_length"] for r in rows if r["temperature"] == temperature
                            and r["category"] == c and (r["stage"], drafter_name(r), r["K"]) == (stage, name, k)),
                           np.nan) for c in categories]
            ax.bar(np.arange(len(categories)) + i * width, values, width, label=f"{stage}: {name} K {k}")
        ax.set_xticks(np.arange(len(categories)) + 0.4 - width / 2, categories, rotation=15)
        ax.set_ylabel("mean acceptance length")
        ax.set_title(f"T = {temperature:g}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    benchmarking.save_figure(fig, path)


def run(args: argparse.Namespace) -> list[dict]:
    runs, out = Path(args.runs), Path(args.out)
    target = str(runs / "target" / "model")
    tokenizer = load_tokenizer(target)
    corpus = DataConfig(corpus_dir=args.corpus_dir, held_out_fraction=args.held_out_fraction)
    out.mkdir(parents=True, exist_ok=True)
    prompts_path = out / "prompts.json"
    if not prompts_path.exists():  # a resumed run keeps its prompts
        prompts = category_prompts(corpus, tokenizer, num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                                   long_prompt_len=args.long_prompt_len, seed=args.seed)
        prompts_path.write_text(json.dumps(prompts))
    prompts = json.loads(prompts_path.read_text())
    drafters = trained_drafters(runs, args.drafters)
    if not drafters:
        raise SystemExit(f"no trained drafter under {runs} (a stage folder with */eval.json): train some first")
    runner, rows, start = Runner(), [], time.perf_counter()
    for category in args.categories:
        (out / category).mkdir(exist_ok=True)
        (out / category / "prompts.json").write_text(json.dumps(prompts[category]))
        # T 1 on every category but the long one, whose programs are compiled for it alone.
        temperatures = args.temperatures if category != "long_context" else args.temperatures[:1]
        for stage, method, folder, points in drafters:
            base = RunConfig(target=target, drafter=str(folder), spec=SpecConfig(method=method),
                             prompts_file=str(out / category / "prompts.json"), max_new_tokens=args.new_tokens,
                             dtype=args.dtype)
            grid = {"spec": [dict(p) for p in points], "sampling.temperature": temperatures}
            sweep = SweepConfig(base=base, grid=grid, output_dir=str(out / category / stage))
            rows += [{**row, "category": category, "stage": stage} for row in run_sweep(sweep, runner)]
        write_report(rows, out, args, time.perf_counter() - start)  # after each category: a cut-short run has one
    return rows


def write_report(rows: list[dict], out: Path, args: argparse.Namespace, seconds: float) -> None:
    """spec_bench.jsonl, .md (the table, its settings and command, the headline comparisons) and .png."""
    (out / "spec_bench.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    first = next((row for row in rows if "skipped" not in row), {})
    header = [f"# Spec-Bench-style table: {args.runs}", "",
              f"Device: {first.get('device')}; JAX {first.get('jax')}; {args.num_prompts} prompts a category (one "
              f"batch), {args.prompt_len} tokens ({args.long_prompt_len} for long_context), {args.new_tokens} new "
              f"tokens, dtype {args.dtype}; {seconds:.0f} s.", "",
              "Cells: mean acceptance length (speedup over autoregressive decoding of the same batch).", "",
              f"Command: `python -m specjax.spec_bench {' '.join(args.argv)}`", ""]
    checks = ["", "At T 0 (issue 41's comparisons):", "", *(headline(rows) or ["- none: their drafters did not run"]), ""]
    (out / "spec_bench.md").write_text("\n".join(header) + "\n" + table(rows) + "\n".join(checks) + "\n")
    plot(rows, out / "spec_bench.png")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="the runs folder of scripts/train_default_models.sh")
    parser.add_argument("--out", required=True, help="where the sweeps, spec_bench.md, .jsonl and .png go")
    parser.add_argument("--corpus-dir", default=None, help="the target's corpus (default: the standard library)")
    parser.add_argument("--held-out-fraction", type=float, default=DataConfig.held_out_fraction,
                        help="the target's data.held_out_fraction (the split must be the target's)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--long-prompt-len", type=int, default=768)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=lambda s: [float(t) for t in s.split(",")], default=[0.0, 1.0])
    parser.add_argument("--drafters", type=lambda s: s.split(","), default=None,
                        help=f"stages to draft with (default: every one trained of {[d[0] for d in DRAFTERS]})")
    parser.add_argument("--categories", type=lambda s: s.split(","), default=list(CATEGORIES),
                        help=f"the categories to run, comma-separated (default every one of {list(CATEGORIES)}): "
                             "e.g. those a cut-short run did not reach")
    parser.add_argument("--dtype", default="float32", help="compute dtype (float32: greedy rows equal AR)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, checked; args.categories in the table's order."""
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [c for c in args.categories if c not in CATEGORIES]
    if unknown or not args.categories:
        parser.error(f"--categories {','.join(args.categories)!r}: allowed a comma-separated subset of "
                     f"{','.join(CATEGORIES)}")
    args.categories = [c for c in CATEGORIES if c in args.categories]
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    return run(parse_args(argv))


if __name__ == "__main__":
    main()

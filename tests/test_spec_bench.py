"""The Spec-Bench-style table's prompt categories: where a function's body and docstring are cut, each
category's prompts of one length from the right files (tests only from test folders, the rest held out), and the
table's cells."""

import re

import numpy as np
import pytest

from specjax import default_models
from specjax.config import DataConfig
from specjax.data.dataset import split_files
from specjax.spec_bench import CATEGORIES, category_prompts, function_cuts, headline, parse_args, table

SOURCE = '''import os


def documented(a, b):
    """Adds — with a non-ASCII dash before the cut."""
    total = a + b
    return total


def bare(x):
    y = x * 2
    return y


def single_quoted(x):
    'not triple quoted'
    return x


def too_short():
    """Only a docstring."""


class Holder:
    async def method(self):
        \'\'\'Inside a class.\'\'\'
        await other()
'''


def test_function_cuts_open_docstrings_after_their_quotes_and_bodies_at_their_first_code_line():
    data = SOURCE.encode()
    cuts = function_cuts(SOURCE)
    # too_short has no code after its docstring: no cut; single_quoted's docstring is not triple quoted.
    assert len(cuts) == 4
    documented, bare, single, method = cuts
    assert data[:documented.docstring].endswith(b'def documented(a, b):\n    """')
    assert data[documented.body:].startswith(b"    total = a + b\n")
    assert bare.docstring is None and data[bare.body:].startswith(b"    y = x * 2\n")
    assert single.docstring is None and data[single.body:].startswith(b"    return x\n")
    assert data[:method.docstring].endswith(b"async def method(self):\n        '''")
    assert data[method.body:].startswith(b"        await other()\n")
    assert function_cuts("def broken(:\n") == []


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_models.tokenizer_folder(default_models.TARGET))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A package of 40 modules of documented functions and a tests/ folder beside them (not the interpreter's
    standard library, whose test folders some distributions leave out)."""
    root = tmp_path_factory.mktemp("corpus")
    for m in range(40):
        functions = "".join(
            f'def scale_{m}_{f}(values, factor={f + 1}):\n    """Multiply each of the values by {f + 1} for module {m}."""\n'
            f"    result = [value * factor for value in values]\n    return sum(result) + {m * f}\n\n\n"
            for f in range(6))
        (root / "package").mkdir(exist_ok=True)
        (root / "package" / f"module_{m}.py").write_text(f"import math\n\nLIMIT = {m}\n\n\n{functions}")
    (root / "package" / "tests").mkdir()
    for m in range(8):
        (root / "package" / "tests" / f"test_module_{m}.py").write_text("".join(
            f"def test_case_{m}_{c}():\n    assert check({m}, {c}) == expected[{c}], 'case {c} of {m}'\n\n\n"
            for c in range(30)))
    return DataConfig(corpus_dir=str(root), held_out_fraction=0.3)


def test_every_category_gives_its_prompts_at_one_length_from_the_files_it_names(tokenizer, corpus):
    prompts = category_prompts(corpus, tokenizer, num_prompts=6, prompt_len=48, long_prompt_len=200, seed=0)
    assert list(prompts) == list(CATEGORIES)
    for category, rows in prompts.items():
        length = 200 if category == "long_context" else 48
        assert len(rows) == 6 and all(len(row) == length for row in rows), category
    # Cut at functions: the docstring prompts end in the quotes that open one, the body prompts at a line's start
    # (the line after the docstring).
    assert all(tokenizer.decode(row).endswith(':\n    """') for row in prompts["docstring"])
    assert all(tokenizer.decode(row).endswith('."""\n') for row in prompts["function_body"])
    # Each prompt comes from its files: held-out ones name functions of held-out modules only (a window may span
    # two files), test windows come from the tests folder, which training never reads.
    _, train, held_out = split_files(corpus)
    held_out_modules = {int(path.stem.split("_")[1]) for path in held_out}
    assert held_out_modules and len(train) > len(held_out)
    for category in ("held_out", "function_body", "docstring", "long_context"):
        named = {int(m) for row in prompts[category] for m in re.findall(r"def scale_(\d+)_", tokenizer.decode(row))}
        assert named and named <= held_out_modules, (category, named - held_out_modules)
    for row in prompts["tests"]:
        text = tokenizer.decode(row)
        assert "assert check(" in text and "scale_" not in text
    # A second call gives the same prompts (a resumed table keeps them), another seed others.
    again = category_prompts(corpus, tokenizer, num_prompts=6, prompt_len=48, long_prompt_len=200, seed=0)
    assert again == prompts
    other = category_prompts(corpus, tokenizer, num_prompts=6, prompt_len=48, long_prompt_len=200, seed=1)
    assert other["function_body"] != prompts["function_body"]


def test_too_few_functions_for_the_prompts_asked_is_an_error_that_says_what_to_change(tokenizer, corpus):
    with pytest.raises(ValueError, match=r"function_body prompts of 48 tokens, fewer than 500: use fewer prompts"):
        category_prompts(corpus, tokenizer, num_prompts=500, prompt_len=48, long_prompt_len=64)


def test_the_table_has_a_column_per_category_and_a_row_per_drafter_point():
    def row(category, k, length, speedup, identical=None):
        return {"category": category, "stage": "eagle1", "method": "eagle", "K": k, "temperature": 0.0,
                "mean_acceptance_length": length, "speedup": speedup, "greedy_identical_rows": identical,
                "prompts": 4}

    rows = [row("held_out", 5, 3.5, 1.2, 4), row("tests", 5, 2.25, 0.9, 4), row("held_out", 6, 3.75, 1.25, 4),
            {**row("tests", 6, np.nan, np.nan), "skipped": "unsupported"}]
    lines = table(rows).splitlines()
    assert lines[0] == "| drafter | run | K | T | held_out | tests | rows = AR |"
    assert lines[2] == "| eagle | eagle1 | 5 | 0 | 3.50 (1.20x) | 2.25 (0.90x) | 4/4 |"
    assert lines[3] == "| eagle | eagle1 | 6 | 0 | 3.75 (1.25x) |  | 4/4 |"


def test_the_headline_compares_eagle3_with_eagle1_trees_with_their_chain_and_dspark_with_dflash():
    def row(stage, k, length, nodes=None, category="held_out"):
        return {"category": category, "stage": stage, "K": k, "temperature": 0.0, "tree_nodes": nodes,
                "mean_acceptance_length": length}

    rows = [row("eagle1", 5, 4.0), row("eagle3", 5, 5.0), row("eagle1", 6, 4.0), row("eagle1", 6, 5.2, nodes=60),
            row("dflash", 15, 6.0), row("dspark", 15, 6.6), row("dspark", 15, 3.0, category="tests"),
            {**row("eagle3", 5, 9.0), "temperature": 1.0}]  # T 1: not a headline
    assert headline(rows) == [
        "- held_out: EAGLE-3 5.00 against EAGLE-1 4.00 at K 5 (1.25x); eagle1 60-node tree 1.30x its K 6 chain; "
        "DFlash 6.00 at K 15; DSpark 6.60 at K 15 (1.10x DFlash).",
        "- tests: DSpark 3.00 at K 15."]


def test_categories_run_in_the_tables_order_and_an_unknown_one_is_refused_with_what_is_allowed(capsys):
    base = ["--runs", "r", "--out", "o"]
    assert parse_args(base).categories == list(CATEGORIES)
    assert parse_args(base + ["--categories", "long_context,tests"]).categories == ["tests", "long_context"]
    with pytest.raises(SystemExit):
        parse_args(base + ["--categories", "tests,docstrings"])
    assert "--categories 'tests,docstrings': allowed a comma-separated subset of held_out," in capsys.readouterr().err

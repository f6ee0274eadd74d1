"""The bundled default models: a 12.6M-parameter code LM (the target), a 1.4M-parameter draft LM on
its tokenizer, and EAGLE-1, EAGLE-3 and Medusa heads, a DFlash drafter, a DSpark drafter and an MTP module
for the target, trained on the Python standard library by scripts/train_default_models.sh (DSpark: its
`dspark` stage). MODEL_CARD.md beside this file gives their figures (mtp/eval.json the MTP module's: until the
H200 run of the script's mtp stage, a module trained for 400 steps on the CPU, docs/performance.md
"Acceptance: MTP on the default models").

Anywhere specjax takes a model folder (configs, `specjax generate --model`), `default:NAME` names one of
them; the draft shares the target's tokenizer. Which one a method drafts with by default is its
proposer's `default_drafter` (specjax.proposers).
"""

from __future__ import annotations

from pathlib import Path

NAMES = ("target", "draft", "eagle1", "eagle3", "medusa", "dflash", "dspark", "mtp")
PREFIX = "default:"
TARGET = PREFIX + "target"


def path(name: str) -> Path:
    if name not in NAMES:
        raise ValueError(f"default model {name!r} does not exist: allowed {list(NAMES)}")
    folder = Path(__file__).parent / name
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"the default model folder {folder} is incomplete (no config.json): reinstall "
                                "specjax or run scripts/train_default_models.sh")
    return folder


def resolve(folder: str | Path) -> Path:
    """A folder, with `default:NAME` standing for the bundled model NAME."""
    folder = str(folder)
    return path(folder[len(PREFIX):]) if folder.startswith(PREFIX) else Path(folder)


def tokenizer_folder(folder: str | Path) -> Path:
    """Where a model's tokenizer lives: the bundled draft uses the target's."""
    return path("target") if str(folder) == PREFIX + "draft" else resolve(folder)


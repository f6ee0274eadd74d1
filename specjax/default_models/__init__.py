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

import lzma
import os
import shutil
import tempfile
from pathlib import Path

NAMES = ("target", "draft", "eagle1", "eagle3", "medusa", "dflash", "dspark", "mtp")
PREFIX = "default:"
TARGET = PREFIX + "target"
# The weights are stored xz-compressed (a third smaller: the repository must fit what a GPU machine's call takes,
# docs/performance.md) and unpacked at first use: beside themselves, or where the package is read-only, here.
PACKED = ".xz"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specjax" / "default_models"


def path(name: str) -> Path:
    """The folder of the bundled model NAME, its weights unpacked."""
    if name not in NAMES:
        raise ValueError(f"default model {name!r} does not exist: allowed {list(NAMES)}")
    folder = Path(__file__).parent / name
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"the default model folder {folder} is incomplete (no config.json): reinstall "
                                "specjax or run scripts/train_default_models.sh")
    return unpack(folder)


def unpack(folder: Path) -> Path:
    """A model folder with its packed weights (FILE.xz) unpacked beside them (FILE), unless there already and no
    older than the packed file; a copy in CACHE where the folder is read-only. A folder without packed weights
    is returned as it is."""
    folder = Path(folder)
    packed = sorted(folder.glob("*" + PACKED))
    if not packed:
        return folder
    try:
        for file in packed:
            _unpack_file(file, folder / file.stem)
        return folder
    except PermissionError:
        cache = CACHE / folder.name
        cache.mkdir(parents=True, exist_ok=True)
        for file in folder.iterdir():
            if file.is_file() and file.suffix != PACKED:
                shutil.copy2(file, cache / file.name)
        for file in packed:
            _unpack_file(file, cache / file.stem)
        return cache


def _unpack_file(packed: Path, out: Path) -> None:
    if out.exists() and out.stat().st_mtime >= packed.stat().st_mtime:
        return
    # A temporary file renamed into place: two processes unpacking at once (test workers) never read half a file.
    with tempfile.NamedTemporaryFile(dir=out.parent, prefix=out.name, delete=False) as tmp:
        with lzma.open(packed) as source:
            shutil.copyfileobj(source, tmp, 1 << 22)
    os.replace(tmp.name, out)


def pack(folder: Path) -> None:
    """Stores a model folder's weights (*.safetensors) packed as the package ships them (FILE.xz beside FILE,
    which git ignores), where the packed file is missing or older than FILE."""
    for file in sorted(Path(folder).glob("*.safetensors")):
        packed, stat = file.with_name(file.name + PACKED), file.stat()
        if packed.exists() and packed.stat().st_mtime >= stat.st_mtime:
            continue
        with open(file, "rb") as source, lzma.open(packed, "wb", preset=6) as out:
            shutil.copyfileobj(source, out, 1 << 22)
        os.utime(packed, (stat.st_atime, stat.st_mtime))  # as old as FILE: neither packed nor unpacked again


def shipped_bytes(folder: Path) -> int:
    """Bytes the package ships for a folder of models: packed weights counted, their unpacked copies not."""
    files = [f for f in Path(folder).rglob("*") if f.is_file()]
    packed = {f.with_suffix("") for f in files if f.suffix == PACKED}
    return sum(f.stat().st_size for f in files if f not in packed)


def resolve(folder: str | Path) -> Path:
    """A folder, with `default:NAME` standing for the bundled model NAME."""
    folder = str(folder)
    return path(folder[len(PREFIX):]) if folder.startswith(PREFIX) else Path(folder)


def tokenizer_folder(folder: str | Path) -> Path:
    """Where a model's tokenizer lives: the bundled draft uses the target's."""
    return path("target") if str(folder) == PREFIX + "draft" else resolve(folder)


"""Install a train-mtp run's modules as the bundled default:mtp, in bfloat16 (MiMo's tensor names, with the
run's eval.json), refusing more than --max-mb:

    PYTHONPATH=. python scripts/install_mtp.py --run runs/default/mtp [--out specjax/default_models/mtp]
"""

import argparse
import dataclasses
import shutil
from pathlib import Path

from specjax import default_models
from specjax.models import hf
from specjax.models.mtp import load_mtp, save_mtp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a train-mtp output_dir (holding mtp/)")
    parser.add_argument("--target", default=default_models.TARGET, help="the target the modules were trained for")
    parser.add_argument("--out", type=Path, default=Path(default_models.__file__).parent / "mtp")
    parser.add_argument("--max-mb", type=float, default=8.0)
    args = parser.parse_args()
    target_config = dataclasses.replace(hf.load_config(default_models.resolve(args.target)), param_dtype="bfloat16",
                                        dtype="bfloat16")
    save_mtp(load_mtp(args.run / "mtp", target_config), args.out)
    shutil.copy(args.run / "mtp/eval.json", args.out / "eval.json")
    default_models.pack(args.out)  # as the package ships it
    size = default_models.shipped_bytes(args.out) / 1e6
    if size > args.max_mb:
        shutil.rmtree(args.out)
        raise SystemExit(f"{args.run}: the modules take {size:.1f} MB in bfloat16, more than --max-mb {args.max_mb}")
    print(f"installed {args.out} ({size:.2f} MB)")


if __name__ == "__main__":
    main()

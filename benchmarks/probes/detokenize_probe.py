"""Microseconds a token of the server's Detokenizer on the bundled tokenizer, streaming a Python source file's tokens
one visit at a time, through tokenizers' DecodeStream and by decoding the prefix again (the fallback):

    PYTHONPATH=. python benchmarks/probes/detokenize_probe.py [--visit 1] [--lengths 128,512,2048]
"""

import argparse
import time
from pathlib import Path

from transformers import AutoTokenizer

from specjax import default_models
from specjax.serve import Detokenizer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--visit", type=int, default=1, help="ids handed over at once (a visit's tokens of a request)")
    parser.add_argument("--lengths", default="128,512,2048")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(default_models.tokenizer_folder(default_models.TARGET))
    ids = tokenizer.encode(Path(__file__).parents[2].joinpath("specjax/decoding.py").read_text(),
                           add_special_tokens=False)
    for length in map(int, args.lengths.split(",")):
        row = []
        for streams in (True, False):
            detokenizer = Detokenizer(tokenizer)
            if not streams:
                detokenizer.stream = None
            start = time.perf_counter()
            for i in range(0, length, args.visit):
                detokenizer.add(ids[i:min(i + args.visit, length)])
            row.append((time.perf_counter() - start) / length * 1e6)
        print(f"{length} tokens, {args.visit} a visit: DecodeStream {row[0]:.1f} us a token, prefix {row[1]:.1f}")


if __name__ == "__main__":
    main()

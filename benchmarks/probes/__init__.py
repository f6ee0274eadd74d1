"""Finished investigations of the decode step's speed, kept runnable from the repository root:
`python -m benchmarks.probes.NAME --help`. Their results are under benchmarks/results/probes/ and what
they concluded is in docs/performance.md; they need a GPU (decode_attention_rounding also runs on the
CPU, in interpret mode)."""

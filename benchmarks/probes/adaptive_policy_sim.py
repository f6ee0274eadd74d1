"""How close adaptive verification's width choice comes to the best fixed width, on a measured cost curve, with
the loop's own estimator (specjax.adaptive: AdaptiveState.observe, choose_width) and synthetic acceptance drawn
as the loop's synthetic verifier draws it (each row's accepted length L with P(L >= i) = rates[i - 1]); no
model runs, so the estimator's loss is seen apart from the switch's cost on the device.

    PYTHONPATH=. python benchmarks/probes/adaptive_policy_sim.py benchmarks/results/adaptive_8b/bench_decode_adaptive_8b.json

For each results row (a batch) of bench_decode.py --adaptive: tokens per second of every fixed compiled width
and of the adaptive choice over `steps` steps (the generation's length at that tau), mean over seeds, all
costed by the row's profiled curve; `--prior pooled` also runs the variant that starts each position at, and
relaxes unverified positions toward, the batch's mean estimate instead of certainty (adaptive.PRIOR).
--estimator RATE,RELAX,PRIOR sets adaptive.ESTIMATE_RATE, RELAX_RATE and PRIOR for the adaptive runs (repeatable:
one line each)."""

import argparse
import json

import jax.numpy as jnp
import numpy as np

from specjax import adaptive


def simulate(rates, widths, costs, batch, steps, seed, policy):
    rng = np.random.default_rng(seed)
    k = len(rates)
    survival = np.asarray(rates)  # P(L >= i)
    state = adaptive.AdaptiveState.init(batch, k)
    active = jnp.ones((batch,), bool)
    tokens = seconds = 0.0
    chosen = []
    for _ in range(steps):
        if policy == "adaptive":
            index = int(adaptive.choose_width(state.acceptance, active, widths, jnp.asarray(costs)))
        else:
            index = widths.index(policy)
        width = widths[index]
        u = rng.random(batch)
        length = (u[:, None] < survival[None, :]).sum(axis=1)  # accepted if the profile allows
        accepted = np.minimum(length, width)
        state = state.observe(active, jnp.full((batch,), width, jnp.int32), jnp.asarray(accepted, jnp.int32))
        tokens += batch + accepted.sum()
        seconds += costs[index]
        chosen.append(width)
    return tokens / seconds, float(np.mean(chosen))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--estimator", action="append", default=[],
                        help="RATE,RELAX,PRIOR: adaptive's estimator constants for an extra adaptive run")
    args = parser.parse_args()
    for path in args.results:
        data = json.load(open(path))
        rates = data["meta"]["acceptance_rates"]
        for row in data["rows"]:
            name = next(key for key in row if key.endswith("_adaptive_curve"))
            curve = {int(w): s for w, s in row[name].items()}
            widths = sorted(curve)
            costs = [curve[w] for w in widths]
            tau = 1 + sum(rates)
            steps = int(np.ceil(row["new"] / tau))
            fixed = {w: np.mean([simulate(rates, widths, costs, row["B"], steps, s, w)[0] for s in range(args.seeds)])
                     for w in widths}
            best = max(fixed, key=fixed.get)
            print(f"B {row['B']}: fixed widths (curve-costed) " + ", ".join(f"{w}: {v:,.0f}" for w, v in fixed.items()))
            defaults = f"{adaptive.ESTIMATE_RATE},{adaptive.RELAX_RATE},{adaptive.PRIOR}"
            for estimator in [defaults, *args.estimator]:
                adaptive.ESTIMATE_RATE, adaptive.RELAX_RATE, adaptive.PRIOR = map(float, estimator.split(","))
                runs = [simulate(rates, widths, costs, row["B"], steps, s, "adaptive") for s in range(args.seeds)]
                print(f"  adaptive (rate, relax, prior {estimator}): {np.mean([r[0] for r in runs]):,.0f} tok/s at "
                      f"mean width {np.mean([r[1] for r in runs]):.1f} = {np.mean([r[0] for r in runs]) / fixed[best]:.3f}"
                      f" of width {best}")
            adaptive.ESTIMATE_RATE, adaptive.RELAX_RATE, adaptive.PRIOR = map(float, defaults.split(","))


if __name__ == "__main__":
    main()

"""How close adaptive verification's width choice comes to the best fixed width, on a measured cost curve, with
the loop's own estimator and choice (specjax.adaptive: AdaptiveState, choose_width) and synthetic acceptance
drawn as the loop's synthetic verifier draws it (each row's accepted length L with P(L >= i) = rates[i - 1]);
no model runs, so the estimator's loss is seen apart from the switch's cost on the device.

    PYTHONPATH=. python benchmarks/probes/adaptive_policy_sim.py benchmarks/results/adaptive_8b/*.json \
        --profile measured --profile geometric:0.835 --profile 'measured|geometric:0.95'

For each results row (a batch) of bench_decode.py --adaptive: tokens per second of every fixed compiled width
and of the adaptive choice over `steps` steps (the generation's length at the profile's tau), mean over seeds,
all costed by the row's profiled curve, and adaptive's ratio to the best fixed width. --min-saving sets the
loop's pruning of the widths that save too little (adaptive.worth_choosing; 0 turns it off). --finish steps as static
generation does (every row stops at the length and the batch runs until its last row has it), which is what
bench_decode measures: without it the probe steps until the mean row is done and misses the slowest row's steps.

--profile (repeatable; default `measured`): `measured` is the results file's profile, `geometric:A` has
P(L >= i) = A^i (EAGLE-like: a flat conditional acceptance A), `P|Q` gives the even rows profile P and the odd
rows Q (a heterogeneous batch; batch 1 is one row of P).
--skip: width 0 skips drafting (a drafter with Proposer.idle): its cost is the row's autoregressive forward
(t_ar_forward_s) instead of the curve's drafter plus one-position forward, so that "fixed width 0" is
autoregressive decoding and the ratio is to the best of it and every fixed width.
--estimator (repeatable; default `counts` and `moving-average`): `counts[:DISCOUNT,ROW,PRIOR,PRIOR_TESTS]` is the
loop's estimator (adaptive.AdaptiveState) with its constants optionally replaced; `moving-average[:RATE,RELAX,
PRIOR]` is the estimator before issue 39's (each row's exponential moving average of a position's outcomes,
untested positions relaxed toward PRIOR; defaults 0.2, 0.02, 1.0), kept here as the baseline."""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from specjax import adaptive


def profile_rates(spec: str, measured: list[float], batch: int) -> np.ndarray:
    """P(L >= i) for each row, [batch, K]."""
    k = len(measured)
    if "|" in spec:
        halves = [profile_rates(part, measured, batch) for part in spec.split("|", 1)]
        return np.where((np.arange(batch) % 2 == 0)[:, None], halves[0], halves[1])
    if spec == "measured":
        rates = np.asarray(measured)
    elif spec.startswith("geometric:"):
        rates = float(spec.split(":")[1]) ** np.arange(1, k + 1)
    else:
        raise ValueError(f"--profile {spec!r} is invalid: allowed measured, geometric:A, P|Q")
    return np.broadcast_to(rates, (batch, k))


class Counts:
    """The loop's estimator, adaptive.AdaptiveState, with its module constants set while it is traced."""

    def __init__(self, values: str):
        names = ("DISCOUNT", "ROW_PRIOR_TESTS", "PRIOR", "PRIOR_TESTS")
        defaults = [getattr(adaptive, name) for name in names]
        given = [float(v) for v in values.split(",")] if values else defaults
        self.constants = dict(zip(names, given))
        self.label = "counts (discount, row prior tests, prior, prior tests " + ",".join(f"{v:g}" for v in given) + ")"

    def init(self, batch, k):
        return adaptive.AdaptiveState.init(batch, k)

    def estimate(self, state, active):
        return state.estimate(active)

    def observe(self, state, active, verified, accepted):
        return state.observe(active, verified, accepted)

    def traced(self, fn):
        def wrapped(*args):
            saved = {name: getattr(adaptive, name) for name in self.constants}
            for name, value in self.constants.items():
                setattr(adaptive, name, value)
            try:
                return fn(*args)
            finally:
                for name, value in saved.items():
                    setattr(adaptive, name, value)
        return wrapped


class MovingAverage:
    """The estimator before issue 39's: c[b, i] an exponential moving average of tested outcomes, positions a
    row did not test relaxed toward PRIOR, every position starting at PRIOR."""

    def __init__(self, values: str):
        self.rate, self.relax, self.prior = (float(v) for v in values.split(",")) if values else (0.2, 0.02, 1.0)
        self.label = f"moving average (rate, relax, prior {self.rate:g},{self.relax:g},{self.prior:g})"

    def init(self, batch, k):
        return jnp.full((batch, k), self.prior, jnp.float32)

    def estimate(self, state, active):
        return state

    def observe(self, state, active, verified, accepted):
        position = jnp.arange(1, state.shape[1] + 1)[None, :]
        tested = active[:, None] & (position <= verified[:, None]) & (position <= accepted[:, None] + 1)
        passed = (position <= accepted[:, None]).astype(jnp.float32)
        seen = state + self.rate * (passed - state)
        relaxed = state + self.relax * (self.prior - state)
        return jnp.where(tested, seen, jnp.where(active[:, None], relaxed, state))

    def traced(self, fn):
        return fn


ESTIMATORS = {"counts": Counts, "moving-average": MovingAverage}


def estimator_of(spec: str):
    name, _, values = spec.partition(":")
    if name not in ESTIMATORS:
        raise ValueError(f"--estimator {spec!r} is invalid: allowed {', '.join(ESTIMATORS)}[:constants]")
    return ESTIMATORS[name](values)


def lengths(rng, rates):
    """Each row's accepted length if the profile allows: L with P(L >= i) = rates[b, i - 1]."""
    return (rng.random(rates.shape[0])[:, None] < rates).sum(axis=1)


def simulate_fixed(rates, costs, index, width, steps, seed, new_tokens=None):
    """Tokens per second at a fixed width over `steps` steps; with new_tokens, as static generation runs: each row
    stops at new_tokens and the batch steps until its last row has them (finish_of)."""
    rng = np.random.default_rng(seed)
    if new_tokens is not None:
        return finish_of(lambda active: (index, np.minimum(lengths(rng, rates), width)), rates.shape[0],
                         new_tokens, costs)[0]
    tokens = sum(rates.shape[0] + np.minimum(lengths(rng, rates), width).sum() for _ in range(steps))
    return tokens / (steps * costs[index])


def finish_of(step, batch, new_tokens, costs):
    """Static generation: step(active) -> (width index, accepted drafts a row) until every row has emitted
    new_tokens (a row emits its accepted drafts and one token a step, capped at new_tokens; a finished row is
    inactive but its slot is still computed). Returns tokens per second and the widths chosen."""
    emitted = np.zeros(batch, np.int64)
    seconds, chosen = 0.0, []
    while (emitted < new_tokens).any():
        active = emitted < new_tokens
        index, accepted = step(active)
        emitted = np.where(active, np.minimum(emitted + 1 + accepted, new_tokens), emitted)
        seconds += costs[index]
        chosen.append(index)
    return batch * new_tokens / seconds, chosen


def adaptive_step(estimator, widths):
    """One step's choice and observation, jitted once per estimator and widths."""
    def step(state, active, costs, length):
        index = adaptive.choose_width(estimator.estimate(state, active), active, widths, costs)
        width = jnp.asarray(widths, jnp.int32)[index]
        accepted = jnp.minimum(length, width)
        verified = jnp.full(length.shape, width, jnp.int32)
        return estimator.observe(state, active, verified, accepted), index, jnp.sum(accepted)

    return jax.jit(estimator.traced(step))


def simulate_adaptive(step, estimator, rates, widths, costs, new_tokens, seed, finish=False,
                      min_saving=adaptive.MIN_SAVING):
    """Steps until the batch has emitted new_tokens a row on average (a step that skips drafting emits one a row);
    with finish, until every row has (finish_of), the estimate and choice over the unfinished rows as in the loop."""
    rng = np.random.default_rng(seed)
    batch, k = rates.shape
    state, active = estimator.init(batch, k), jnp.ones((batch,), bool)
    # What the loop chooses by (adaptive.verify_costs: widths not worth choosing priced out); steps cost `costs`.
    costs_array = jnp.asarray(np.where(adaptive.worth_choosing(np.asarray(costs), min_saving), costs,
                                       adaptive.FORCED_OUT), jnp.float32)
    if finish:
        holder = [state]

        def one(active):
            length = jnp.asarray(lengths(rng, rates), jnp.int32)
            holder[0], index, _ = step(holder[0], jnp.asarray(active), costs_array, length)
            return int(index), np.minimum(np.asarray(length), widths[int(index)])

        rate, chosen = finish_of(one, batch, new_tokens, costs)
        return rate, float(np.mean([widths[i] for i in chosen]))
    tokens = seconds = 0.0
    chosen = []
    while tokens < batch * new_tokens:
        state, index, accepted = step(state, active, costs_array, jnp.asarray(lengths(rng, rates), jnp.int32))
        index = int(index)
        tokens += batch + int(accepted)
        seconds += costs[index]
        chosen.append(widths[index])
    return tokens / seconds, float(np.mean(chosen))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--profile", action="append", default=[], help="measured, geometric:A, or P|Q (see above)")
    parser.add_argument("--estimator", action="append", default=[],
                        help="counts[:DISCOUNT,ROW,PRIOR,PRIOR_TESTS] or moving-average[:RATE,RELAX,PRIOR]")
    parser.add_argument("--skip", action="store_true",
                        help="width 0 skips drafting: costed as the row's autoregressive forward")
    parser.add_argument("--new-tokens", type=int, default=None, help="the generation's length (default: the row's)")
    parser.add_argument("--finish", action="store_true",
                        help="static generation's ends: every row stops at the length, the batch steps until the "
                             "last has it (its slowest row's steps), as bench_decode measures; else the mean row's")
    parser.add_argument("--min-saving", type=float, default=adaptive.MIN_SAVING,
                        help="adaptive.MIN_SAVING: a width is chosen only where it saves this share of a step "
                             "against the next wider one (0: every width)")
    args = parser.parse_args()
    estimators = [estimator_of(spec) for spec in (args.estimator or ["moving-average", "counts"])]
    for path in args.results:
        data = json.load(open(path))
        measured = data["meta"]["acceptance_rates"]
        for row in data["rows"]:
            name = next(key for key in row if key.endswith("_adaptive_curve"))
            curve = {int(w): s for w, s in row[name].items()}
            if args.skip:
                curve[0] = row["t_ar_forward_s"]
            widths = tuple(sorted(curve))
            costs = [curve[w] for w in widths]
            steps_by = {}
            for spec in args.profile or ["measured"]:
                rates = profile_rates(spec, measured, row["B"])
                tau = 1 + rates.sum(axis=1).mean()
                steps = int(np.ceil((args.new_tokens or row["new"]) / tau))
                length = (args.new_tokens or row["new"]) if args.finish else None
                fixed = {w: np.mean([simulate_fixed(rates, costs, i, w, steps, s, length) for s in range(args.seeds)])
                         for i, w in enumerate(widths)}
                best = max(fixed, key=fixed.get)
                print(f"B {row['B']}, profile {spec} (tau {tau:.2f}, {steps} steps): fixed widths (curve-costed) "
                      + ", ".join(f"{w}: {v:,.0f}" for w, v in fixed.items()))
                for estimator in estimators:
                    step = steps_by.setdefault(estimator.label, adaptive_step(estimator, widths))
                    runs = [simulate_adaptive(step, estimator, rates, widths, costs, args.new_tokens or row["new"], s,
                                              args.finish, args.min_saving) for s in range(args.seeds)]
                    rate = np.mean([r[0] for r in runs])
                    print(f"  {estimator.label}: {rate:,.0f} tok/s at mean width {np.mean([r[1] for r in runs]):.1f}"
                          f" = {rate / fixed[best]:.3f} of width {best}")


if __name__ == "__main__":
    main()

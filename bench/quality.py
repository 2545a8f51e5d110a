"""Model quality at equal tokens: data parallel vs DiLoCo vs Streaming vs Decoupled DiLoCo.

Every run trains the same model from the same initialisation on the same
token budget in the simulated driver (virtual clock, real JAX training), and
reports final eval loss, goodput and tokens. Every run sees the same stated
deployment (``deployment``): lognormal step-time noise and WAN links scaled
down from a 10B-parameter run, so that the methods differ in time as they would
in a real run. Writes bench/results/quality.json (each row as its run finishes,
so a stopped run keeps the rows it has; a rerun keeps the rows it does not
redo) and bench/results/quality.png (eval loss against tokens).

    python bench/quality.py            # tiny preset, ~2 h on 2 idle CPU cores (23 runs, 2 at a time)
    python bench/quality.py --quick    # same runs, fewer tokens, ~5 min
    python bench/quality.py --only dp decoupled --tokens 4e6
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from wan_diloco import model, sim, spec as spec_lib  # noqa: E402
from wan_diloco.checkpoint import write_atomic  # noqa: E402
from wan_diloco.tape import Outage  # noqa: E402

# Decoupled settings chosen from the calibration in docs/quality.md (K = 1 + grace, balanced fragments).
DECOUPLED = dict(baseline="decoupled", learners=4, quorum=1, grace=True, fragments=4, tau=2)
DOWN_FRACTION = 0.25  # share of learner time the failure tape keeps learners down
TAPE_SEED, TAPE_CYCLES = 1234, 6  # the failure rows' tape (``failure_tape``), the same whatever --seed
HETERO = dict(speeds=(1.0, 1.0, 1.0, 1.2), step_noise=0.1)

# The deployment every row runs under (a row's own settings win: the hetero rows keep their speeds).
# Links: the Decoupled row uses the same share of its link as a large run does of its own. The large
# run is 10B parameters, 1 s steps, 2 Gbit/s, 80 ms, with Streaming DiLoCo's H = 100 and 4-bit outer
# gradients: it moves 10e9 x 4 / 100 = 0.4 Gbit per step each way, 20 % of its link. The tiny row moves
# params x bits / H per step (853,120 x 32 / 8 = 3.41 Mbit, or 6.8 Mbit/s at 0.5 s steps), so
#     rate = (params x bits / H / step_time) / (large params x large bits / large H / large step / large rate)
#          = 6.8 Mbit/s / 0.2 = 34 Mbit/s.
# Scaling bytes alone (same H and bits as the large run) would give 0.34 Mbit/s, 20x less than the bench's
# fp32 H = 8 needs: every DiLoCo row would then be link-bound, which no one would deploy. Data parallel
# moves its gradient every step on the same link (2(M-1)/M x 27.3 Mbit, ~1.2 s per 0.5 s step), so its
# goodput here is low, as over a real WAN. The RTT is kept in steps: 80 ms x 0.5 s / 1 s = 40 ms, so τ,
# the grace window and dp's (M-1)·RTT weigh the same. Step noise: lognormal, sigma 0.1, drawn per learner
# from the run's seed (``default_rng([seed, m])`` in the drivers), so a run is reproducible.
LARGE_RUN = dict(params=10e9, step_time_s=1.0, bandwidth_gbit_s=2.0, rtt_s=0.080, sync_every=100, bits=4)
STEP_TIME_S = 0.5  # virtual seconds per step of the tiny preset (the simulator's default)
STEP_NOISE = 0.1  # sigma of the lognormal step-time noise
ROW_SYNC_EVERY, ROW_BITS = 8, 32  # the Decoupled row's H and outer-gradient bits (the bench's defaults)


def deployment(preset: str, step_time_s: float = STEP_TIME_S, step_noise: float = STEP_NOISE,
               large: dict = LARGE_RUN, sync_every: int = ROW_SYNC_EVERY, bits: int = ROW_BITS) -> dict:
    """The stated deployment of ``preset``: noise, step time and links scaled from ``large`` (see above)."""
    params = model.param_count(model.abstract_params(model.preset(preset)))
    share = large["params"] * large["bits"] / large["sync_every"] / large["step_time_s"] / (
        large["bandwidth_gbit_s"] * 1e9)  # of its link the large run uses, each way
    demand = params * bits / sync_every / step_time_s  # bit/s the Decoupled row moves each way
    bandwidth = demand / share / 1e9
    return {
        "step_noise": step_noise, "step_time_s": step_time_s, "bandwidth_gbit_s": bandwidth,
        "rtt_s": large["rtt_s"] * step_time_s / large["step_time_s"], "params": params,
        "link_share": share, "row_sync_every": sync_every, "row_bits": bits,
        "fp32_model_transfer_steps": params * 32 / (bandwidth * 1e9) / step_time_s,
        "failure_tape": {"rows": "failures=True", "down_fraction": DOWN_FRACTION, "seed": TAPE_SEED,
                         "cycles": TAPE_CYCLES},
        "scaled_from": large,
        "rule": "bandwidth = (params * bits / H / step_time) / link_share, link_share = the large run's "
                "(params * bits / H / step_time) / rate; rtt = large.rtt * step_time / large.step_time",
    }


def deployment_settings(dep: dict) -> dict:
    """The ``spec.SHORT_NAMES`` settings of a deployment."""
    return {k: dep[k] for k in ("step_noise", "step_time_s", "bandwidth_gbit_s", "rtt_s")}


def parse_settings(pairs: list[str]) -> dict:
    """``--set NAME=VALUE`` pairs as settings: VALUE read as JSON (0.6, true, [1, 2]), else as a string."""
    out = {}
    for pair in pairs:
        name, eq, text = pair.partition("=")
        if not eq or not name:
            raise ValueError(f"{pair!r} is not NAME=VALUE")
        try:
            out[name] = json.loads(text)
        except ValueError:
            out[name] = text
    return out


def row_settings(overrides: dict, common: dict) -> tuple[dict, bool]:
    """One row's settings (the deployment and budget in ``common``, the row's own win) and whether it fails."""
    merged = {**common, **overrides}
    failures = merged.pop("failures", False)
    return merged, failures


def runs(sync_every: int) -> dict[str, dict]:
    """Run name -> settings (``spec.SHORT_NAMES``). The same token budget and seed everywhere."""
    return {
        "dp": dict(baseline="dp", learners=4),
        "diloco": dict(baseline="diloco", learners=4, sync_every=sync_every),
        "streaming": dict(baseline="streaming", learners=4, fragments=4, tau=2, sync_every=sync_every),
        "decoupled": dict(DECOUPLED, sync_every=sync_every),
        "decoupled_failures": dict(DECOUPLED, sync_every=sync_every, failures=True),
        # The same tape with a down learner's shard left unread until it returns (shards hold different files).
        "decoupled_failures_nofailover": dict(DECOUPLED, sync_every=sync_every, failures=True, data_failover=False),
        "dp_failures": dict(baseline="dp", learners=4, failures=True),
        "decoupled_hetero_grace": dict(DECOUPLED, sync_every=sync_every, **HETERO),
        "decoupled_hetero_nograce": dict(DECOUPLED, sync_every=sync_every, grace=False, **HETERO),
        "decoupled_m8_rda": dict(DECOUPLED, learners=8, merge="rda", sync_every=sync_every),
        "decoupled_m8_mean": dict(DECOUPLED, learners=8, merge="mean", sync_every=sync_every),
        # Bits sweep: "decoupled" above is the 32-bit run.
        "decoupled_int8": dict(DECOUPLED, sync_every=sync_every, bits=8),
        "decoupled_int4": dict(DECOUPLED, sync_every=sync_every, bits=4),
        "decoupled_int4_ef": dict(DECOUPLED, sync_every=sync_every, bits=4, error_feedback=True),
        # The targets are at the wire a WAN run uses (NF4 + error feedback): with the failure tape,
        # at M = 8, and with the staleness gate (the one option never worse than Nesterov in the delay sweep).
        "decoupled_int4_ef_failures": dict(DECOUPLED, sync_every=sync_every, bits=4, error_feedback=True,
                                           failures=True),
        "decoupled_int4_ef_m8": dict(DECOUPLED, learners=8, merge="rda", sync_every=sync_every, bits=4,
                                     error_feedback=True),
        "decoupled_int4_ef_gate": dict(DECOUPLED, sync_every=sync_every, bits=4, error_feedback=True,
                                       staleness="gate"),
        # Fewer steps between syncs, which 4-bit outer gradients leave room for on the same link: the deployment
        # sizes it for fp32 at H = 8 (4 bits per parameter per step); NF4 at H = 4 moves 1, at H = 2 moves 2.
        **{f"decoupled_int4_ef{m}_h{h}": dict(DECOUPLED, sync_every=h, tau=1, bits=4, error_feedback=True, **kw)
           for h in (4, 2) for m, kw in (("", {}), ("_failures", dict(failures=True)),
                                         ("_m8", dict(learners=8, merge="rda")))},
    }


def down_share(tape: list[Outage], learners: int, until_s: float) -> float:
    """Share of the learners' time in ``[0, until_s)`` that the tape keeps them down."""
    down = sum(max(0.0, min(o.up_at, until_s) - o.down_at) for o in tape)
    return down / (learners * until_s) if until_s > 0 else 0.0


def failure_tape(learners: int, run_s: float, down_fraction: float, seed: int,
                 cycles: int = 6, tolerance: float = 0.02) -> list[Outage]:
    """Each learner alternates exponential up and down periods, about ``cycles`` of them in ``run_s``.

    ``run_s`` is how long the run is expected to last with the failures. A few
    exponential periods scatter widely, so the first tape seed (from ``seed``
    on) whose outages cover ``down_fraction`` ± ``tolerance`` of the learners'
    time in ``[0, run_s)`` is used; the seed is picked on downtime alone, before
    anything trains. Outages run on past ``run_s`` in case the run lasts longer.
    """
    mean_down = run_s / cycles * down_fraction
    mean_up = run_s / cycles * (1 - down_fraction)
    for s in range(seed, seed + 1000):
        rng = np.random.default_rng(s)
        tape = []
        for m in range(learners):
            t = rng.exponential(mean_up)
            while t < 2 * run_s:
                d = rng.exponential(mean_down)
                tape.append(Outage(learner=m, down_at=float(t), up_at=float(t + d)))
                t += d + rng.exponential(mean_up)
        if abs(down_share(tape, learners, run_s) - down_fraction) <= tolerance:
            return tape
    raise RuntimeError(f"no tape seed in {seed}..{seed + 999} gives down_fraction {down_fraction} ± {tolerance}")


def row(r: sim.SimResult, wall_s: float, down_fraction: float) -> dict:
    """One run's JSON row: the result without its final parameters (numpy arrays, and megabytes), plus the
    seed and outer optimizer it ran with (``None`` for data parallel, which has none)."""
    out = r.to_json()
    out["wan_bytes"] = out.pop("bytes_sent")
    dp = out["config"]["simulate"]["baseline"] == "dp"
    out.update(wall_s=wall_s, down_fraction=down_fraction, seed=out["config"]["run"]["seed"],
               outer=None if dp else dict(out["config"]["syncer"]["outer"]))
    return out


def _one(args: tuple[str, dict, dict]) -> tuple[str, dict]:
    name, overrides, common = args
    settings, failures = row_settings(overrides, common)
    spec = spec_lib.from_short(**settings)
    M = spec.run.learners
    outages = []
    if failures:
        # With a quarter of the learners down the tokens come at 3/4 of the rate: the run lasts 4/3 longer.
        steps = common["tokens"] / (spec.run.batch_size * spec.model.seq_len * M)
        outages = failure_tape(M, steps * spec.simulate.step_time_s / (1 - DOWN_FRACTION), DOWN_FRACTION,
                               seed=TAPE_SEED, cycles=TAPE_CYCLES)
    t0 = time.perf_counter()
    r = sim.run(spec, outages)
    out = row(r, wall_s=time.perf_counter() - t0, down_fraction=down_share(outages, M, r.virtual_time_s))
    print(f"{name:26s} loss {r.final_eval_loss:.4f}  goodput {r.goodput:.3f}  tokens {r.tokens:,}  "
          f"wall {out['wall_s']:.0f}s", flush=True)
    return name, out


# What rows of one results file share: a rerun adds to a file only if these match (``kept_rows``).
HEADER = ("preset", "tokens", "batch_size", "seed", "sync_every", "eval_batches", "deployment", "holdout")
ADDED_LATER = {"holdout": "eval"}  # header keys older files lack, and the value they ran with


def kept_rows(path: Path, header: dict, redo: list[str]) -> dict[str, dict]:
    """The rows of an earlier file at ``path`` that this run does not redo. ValueError, naming the file and
    the settings, if the file is unreadable or its rows ran under other settings (they would not compare)."""
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
        runs = dict(doc["runs"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a results file this benchmark can add to ({e!r}); "
                         "pass --fresh to replace it, or another --out") from None
    differ = [k for k in HEADER if doc.get(k, ADDED_LATER.get(k)) != header[k]]
    if differ:
        raise ValueError(f"{path} holds runs made with other {', '.join(differ)} than this run; "
                         "pass --fresh to replace it, or another --out")
    return {k: v for k, v in runs.items() if k not in redo}


def write_rows(path: Path, header: dict, rows: dict[str, dict], order: list[str]) -> dict[str, dict]:
    """Rewrite ``path`` atomically with the rows so far, in ``order`` (the benchmark's) then any others;
    returns them in that order."""
    ordered = {k: rows[k] for k in order if k in rows} | rows
    write_atomic(path, json.dumps({**header, "runs": ordered}, indent=1).encode())
    return ordered


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.cm.tab20.colors
    for i, (name, r) in enumerate(results.items()):
        pts = [p for p in r["curve"] if p["tokens"] > 0]
        ax.plot([p["tokens"] for p in pts], [p["eval_loss"] for p in pts], label=name, color=colors[i % 20],
                linestyle="--" if name.startswith("dp") else "-", marker="." if name == "dp_failures" else None)
    ax.set_xlabel("tokens (all learners)")
    ax.set_ylabel("eval loss (held-out stdlib files)")
    ax.set_title("Equal-token quality, tiny preset")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(results: dict[str, dict]) -> str:
    dp = results.get("dp", {}).get("final_eval_loss")
    lines = ["| run | final eval loss | vs dp | goodput | uptime | tokens | WAN bytes |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        rel = f"{(r['final_eval_loss'] / dp - 1) * 100:+.1f} %" if dp else ""
        lines.append(f"| {name} | {r['final_eval_loss']:.4f} | {rel} | {r['goodput']:.3f} | {r['uptime']:.3f} "
                     f"| {r['tokens']:,} | {r.get('wan_bytes', r.get('bytes_sent', 0)) / 1e6:,.0f} MB |")
    return "\n".join(lines)


def seeds_markdown(files: dict[int, dict[str, dict]]) -> str:
    """Final eval loss per seed (columns: seed -> that seed's rows) with the gap to the same seed's dp, and
    the mean where a run has every seed; a run a seed lacks shows "–" and gets no mean."""
    seeds = sorted(files)
    names = list(dict.fromkeys(name for s in seeds for name in files[s]))
    lines = ["| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |", "|---" * (len(seeds) + 2) + "|"]
    for name in names:
        cells, losses, gaps = [], [], []
        for s in seeds:
            r, dp = files[s].get(name), files[s].get("dp")
            if r is None:
                cells.append("–")
                continue
            losses.append(r["final_eval_loss"])
            cells.append(f"{losses[-1]:.4f}")
            if dp is not None and name != "dp":
                gaps.append((losses[-1] / dp["final_eval_loss"] - 1) * 100)
                cells[-1] += f" ({gaps[-1]:+.1f} %)"
        mean = f"{np.mean(losses):.4f}" if len(losses) == len(seeds) else ""
        if mean and len(gaps) == len(seeds):
            mean += f" ({np.mean(gaps):+.2f} %)"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens (same run names), ~5 minutes")
    ap.add_argument("--preset", default="tiny", help="tiny | small | base (small/base: machines with an accelerator)")
    ap.add_argument("--tokens", type=float, default=None, help="token budget per run (default 2e6, quick 2.5e5)")
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=1,
                    help="sequences per learner step (dp: learners x this); 1 is where dp itself ends lowest "
                         "at 2M tokens among 16/8/4/2/1, on the mean of three seeds (bench/quality_sweep.py)")
    ap.add_argument("--seed", type=int, default=0, help="model init, data order and step noise (not the tape)")
    ap.add_argument("--bandwidth-gbit", type=float, default=None,
                    help="replace the deployment's scaled link rate (per learner link, each way; recorded in the JSON)")
    ap.add_argument("--only", nargs="*", help="run only these names, started in this order")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel (processes)")
    ap.add_argument("--out", default=None,
                    help="results file: rows are written as each run finishes; a rerun replaces the rows it "
                         "runs and keeps the others if they ran under the same settings")
    ap.add_argument("--fresh", action="store_true", help="start a new --out instead of keeping its other rows")
    ap.add_argument("--holdout", choices=("eval", "validation"), default="eval",
                    help="validation: evaluate on a split held out of the training data, the eval split unread "
                         "(data.holdout); tune settings there (default --out quality_validation.json)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="settings",
                    help="a setting (spec.SHORT_NAMES) over every row run, e.g. outer_lr=0.6 (a JSON value, else "
                         "a string); each row is stored as NAME@setting=value,...: a tuning variant of that row")
    ap.add_argument("--eval-batches", type=int, default=None,
                    help="eval set size in batches of 16 sequences (default 8); fewer only for smoke tests")
    ap.add_argument("--replot", action="store_true", help="redraw the PNG and table from --out without running")
    ap.add_argument("--seeds-table", nargs="+", metavar="FILE",
                    help="print final loss per seed (one results file per seed) and the mean, without running")
    args = ap.parse_args(argv)
    out = Path(args.out or ROOT / "results" / ("quality.json" if args.holdout == "eval" else
                                              "quality_validation.json"))
    if args.seeds_table:
        docs = [json.loads(Path(f).read_text()) for f in args.seeds_table]
        seeds = [d["seed"] for d in docs]
        if len(set(seeds)) != len(seeds):
            ap.error(f"--seeds-table: two files of the same seed ({seeds}); give one file per seed")
        print(seeds_markdown({d["seed"]: d["runs"] for d in docs}))
        return 0
    if args.replot:
        results = json.loads(out.read_text())["runs"]
        plot(results, out.with_suffix(".png"))
        print(markdown(results))
        return 0
    tokens = int(args.tokens or (2.5e5 if args.quick else 2e6))
    steps = tokens // (args.batch_size * model.preset(args.preset).seq_len * 4)
    dep = deployment(args.preset)
    if args.bandwidth_gbit is not None:
        dep.update(bandwidth_gbit_s=args.bandwidth_gbit, scaled_bandwidth_gbit_s=dep["bandwidth_gbit_s"],
                   fp32_model_transfer_steps=dep["params"] * 32 / (args.bandwidth_gbit * 1e9) / dep["step_time_s"])
    common = dict(preset=args.preset, tokens=tokens, batch_size=args.batch_size, eval_every=max(1, steps // 40),
                  seed=args.seed, holdout=args.holdout, **deployment_settings(dep))
    if args.eval_batches is not None:
        common["eval_batches"] = args.eval_batches
    todo = runs(args.sync_every)
    if args.only:
        unknown = set(args.only) - set(todo)
        if unknown:
            ap.error(f"unknown run names {sorted(unknown)}; known: {', '.join(todo)}")
        todo = {k: todo[k] for k in dict.fromkeys(args.only)}  # in the asked order: the first asked land first
    try:
        variant = parse_settings(args.settings)
        for o in todo.values():
            spec_lib.from_short(**row_settings({**o, **variant}, common)[0])
    except ValueError as e:  # ConfigError too: an unknown name or a bad value, before anything runs
        ap.error(f"--set: {e}")
    if variant:
        tag = ",".join(f"{k}={json.dumps(v)}" for k, v in variant.items())
        todo = {f"{k}@{tag}": {**o, **variant} for k, o in todo.items()}
    # Round-tripped through JSON so that it compares equal to a header read back from a file (tuples, ints).
    eval_batches = spec_lib.RunConfig().eval_batches if args.eval_batches is None else args.eval_batches
    header = json.loads(json.dumps({
        "preset": args.preset, "tokens": tokens, "batch_size": args.batch_size, "quick": args.quick,
        "seed": args.seed, "sync_every": args.sync_every, "eval_batches": eval_batches, "deployment": dep,
        "holdout": args.holdout}))
    try:  # a bad setting or an incompatible --out stops here, before any run or write (ConfigError too)
        spec_lib.from_short(**row_settings({}, common)[0])
        rows = {} if args.fresh else kept_rows(out, header, list(todo))
    except ValueError as e:
        ap.error(str(e))
    if rows:
        print(f"{out}: keeping {', '.join(rows)}; running {', '.join(todo)}", flush=True)
    jobs = [(name, o, common) for name, o in todo.items()]
    order = list(runs(args.sync_every))
    results = write_rows(out, header, rows, order)  # now: with --fresh the old rows go before a new one lands
    with mp.get_context("spawn").Pool(args.jobs) if args.jobs > 1 else contextlib.nullcontext() as pool:
        for name, r in pool.imap_unordered(_one, jobs) if pool else map(_one, jobs):
            rows[name] = r
            results = write_rows(out, header, rows, order)
    plot(results, out.with_suffix(".png"))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

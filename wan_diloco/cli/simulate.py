"""`wan-diloco simulate`: the run file on a virtual clock (see wan_diloco.sim); flags override its keys."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from wan_diloco.cli.args import count
from wan_diloco.config import ConfigError

# flag -> (spec.SHORT_NAMES name, type, help)
_FLAGS: dict[str, tuple[str, type, str]] = {
    "--preset": ("preset", str, "model size: tiny | small | base"),
    "--baseline": ("baseline", str, "dp | diloco | streaming | decoupled"),
    "--learners": ("learners", int, "number of learners M"),
    "--quorum": ("quorum", int, "minimum quorum K (decoupled)"),
    "--fragments": ("fragments", int, "number of fragments P"),
    "--sync-every": ("sync_every", int, "H: steps between syncs of one fragment"),
    "--tau": ("tau", int, "overlap: steps a fragment travels while training goes on"),
    "--alpha": ("alpha", float, "mixing: 0 overwrites with the global fragment, 0.5 averages"),
    "--merge": ("merge", str, "rda | mean"),
    "--fragmenter": ("fragmenter", str, "layer | tensor | balanced"),
    "--steps": ("steps", int, "global step budget"),
    "--tokens": ("tokens", int, "token budget over all learners, e.g. 2e6 (replaces --steps)"),
    "--batch-size": ("batch_size", int, "sequences per learner step"),
    "--inner-lr": ("inner_lr", float, "AdamW peak learning rate"),
    "--outer-lr": ("outer_lr", float, "outer Nesterov learning rate"),
    "--outer-momentum": ("outer_momentum", float, "outer Nesterov momentum"),
    "--step-noise": ("step_noise", float, "sigma of lognormal step-time noise"),
    "--step-time": ("step_time_s", float, "base virtual seconds per step"),
    "--bandwidth-gbit": ("bandwidth_gbit_s", float, "per-learner WAN link, Gbit/s each way"),
    "--seed": ("seed", int, "random seed (runs are deterministic for a seed)"),
    "--eval-every": ("eval_every", int, "global steps between eval points (simulate.curve_every_steps)"),
    "--corpus": ("corpus", str, "'stdlib', a text file or directory, or a .bin token file"),
    "--bits": ("bits", int, "wire precision of outer gradients and updates: 32 | 16 | 8 | 4"),
    "--shards": ("shards", int, "syncer shards S, each owning whole fragments"),
    "--shard-merge-gb-s": ("shard_merge_gb_s", float, "GB/s of fp32 outer gradients one shard merges: each merge "
                           "takes its time (plan.shard_merge_gb_s, simulate.merge_takes_time)"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="TOML", help="the run file (the same one `launch` reads); flags override it")
    for flag, (_, typ, help_text) in _FLAGS.items():
        p.add_argument(flag, type=count if typ is int else typ, default=None, help=help_text)
    p.add_argument("--grace", dest="grace", action="store_true", default=None, help="adaptive grace window (default)")
    p.add_argument("--no-grace", dest="grace", action="store_false", help="merge as soon as the quorum is reached")
    p.add_argument("--error-feedback", dest="error_feedback", action="store_true", default=None,
                   help="carry quantization residuals into the next send of each fragment")
    p.add_argument("--keep-local", dest="keep_local", action="store_true", default=None,
                   help="keep the steps taken while a fragment travelled instead of overwriting them")
    p.add_argument("--no-data-failover", dest="data_failover", action="store_false", default=None,
                   help="a down learner's shard waits for it (default: live learners also read it)")
    p.add_argument("--speeds", default=None, help="comma-separated step-time factors per learner, e.g. 1,1,1,1.2")
    p.add_argument("--rtt-ms", type=float, default=None, help="round-trip time of each link, ms")
    p.add_argument("--failures", metavar="TAPE",
                   help="failure tape: JSON list of {learner, down_at, up_at} or {kind: kill_syncer, [shard,] "
                        "down_at, up_at} (virtual s; wan_diloco/tape.py)")
    p.add_argument("--json", metavar="PATH", help="where the results go as JSON, its picture beside it (PATH.png) "
                                                  "(default: run.run_dir/simulate-TIME/simulate.json)")
    p.add_argument("--plot", metavar="PNG", help="where the picture goes: eval loss against tokens, throughput "
                                                 "against virtual time (default: beside the JSON)")
    p.add_argument("--params-out", metavar="PATH",
                   help="write the final global parameters (safetensors, as a real run's params.safetensors)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")


def spec_from_args(args: argparse.Namespace):
    from wan_diloco import spec as spec_lib
    from wan_diloco.config import load_toml

    doc = load_toml(args.config) if args.config else {}
    values = {name: getattr(args, flag[2:].replace("-", "_")) for flag, (name, _, _) in _FLAGS.items()}
    values.update(grace=args.grace, error_feedback=args.error_feedback, keep_local=args.keep_local,
                  data_failover=args.data_failover, rtt_s=None if args.rtt_ms is None else args.rtt_ms / 1000)
    if values["shard_merge_gb_s"] is not None:  # a merge rate given on the command line is one to simulate
        values["merge_takes_time"] = True
    if args.speeds is not None:
        try:
            values["speeds"] = [float(x) for x in args.speeds.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"simulate.speeds: expected comma-separated numbers, got {args.speeds!r}") from None
    spec_lib.set_short(doc, **{k: v for k, v in values.items() if v is not None})
    return spec_lib.from_document(doc)


def run(args: argparse.Namespace) -> int:
    from wan_diloco import api
    from wan_diloco.cli.report import progress_bar, summary_table
    from wan_diloco.tape import load_tape

    spec = spec_from_args(args)
    failures = load_tape(args.failures) if args.failures else []  # a bad tape: its error before any bar
    if args.quiet:
        result = api.simulate(spec, failures)
    else:
        with progress_bar(f"simulate {spec.simulate.baseline} M={spec.run.learners}") as update:
            result = api.simulate(spec, failures, progress=update)
        summary_table(result)
    # Without --json the result still lands somewhere, as chaos's does: a folder of its own under run.run_dir.
    out = Path(args.json or Path(spec.run.run_dir) / time.strftime("simulate-%Y%m%d-%H%M%S") / "simulate.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.to_json(), indent=1))
    print(f"result: {out}")
    plot = args.plot or str(out.with_suffix(".png"))
    plot_result(result, plot)
    print(f"picture: {plot}")
    if args.params_out:
        from wan_diloco.checkpoint import save_params

        Path(args.params_out).parent.mkdir(parents=True, exist_ok=True)
        save_params(args.params_out, result.params, {"source": "simulate", "final_eval_loss": result.final_eval_loss,
                                                     "global_steps": result.global_steps, "tokens": result.tokens})
        print(f"final parameters: {args.params_out} (wan-diloco eval --params {args.params_out} --config ...)")
    return 0


def plot_result(result, path: str) -> None:
    """The simulated run's eval curve against tokens, and its throughput (tokens per virtual second)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from wan_diloco.cli.report import save_figure
    from wan_diloco.runtime.run_plot import rates

    points = [(p["time_s"], p["tokens"]) for p in result.curve]
    fig, (ax, tax) = plt.subplots(2, 1, figsize=(7, 7), height_ratios=(3, 2))
    ax.plot([p["tokens"] for p in result.curve], [p["eval_loss"] for p in result.curve], marker="o",
            label=f"{result.config['simulate']['baseline']}, M = {result.config['run']['learners']}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("held-out eval loss")
    speed = rates(points)
    tax.plot([t for t, _ in speed], [r for _, r in speed], label="all learners")
    tax.set_xlabel("virtual time (s)")
    tax.set_ylabel("tokens / virtual s")
    tax.grid(True, alpha=0.3)
    save_figure(fig, ax, path)

"""Inner-step training throughput (tokens/s) of a model preset on the local devices, and what syncing
costs a learner's step.

Trains on the default stdlib corpus for a few steps per batch size, after one
compile step, and writes bench/results/train_throughput.json.

    python bench/train_throughput.py            # tiny, batch sizes 8 16 32 64, 40 steps each
    python bench/train_throughput.py --quick    # tiny, batch 16, 15 steps
    python bench/train_throughput.py --sync     # learner step time, syncing off / on (bench/learner_sync.py)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax

from wan_diloco import data, model, train


def measure(cfg: model.ModelConfig, batch_size: int, steps: int, tokens) -> dict:
    mesh = train.local_mesh()
    tc = train.TrainConfig(warmup_steps=10, total_steps=max(steps * 2, 20))
    state = train.init_state(cfg, tc, jax.random.key(0))
    step = train.make_train_step(cfg, tc, mesh)
    it = data.batches(tokens, batch_size, cfg.seq_len, seed=0)
    t0 = time.perf_counter()
    state, metrics = step(state, next(it).tokens)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    n_tokens = 0
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(steps):
        b = next(it)
        state, metrics = step(state, b.tokens)
        n_tokens += b.n_tokens
    jax.block_until_ready(metrics)
    wall_s = time.perf_counter() - t0
    # On a shared machine wall-clock rates depend on the neighbours; CPU
    # seconds actually granted to this process are the steadier denominator.
    cpu_s = time.process_time() - cpu0
    return {"batch_size": batch_size, "steps": steps, "tokens_per_s": n_tokens / wall_s,
            "tokens_per_cpu_s": n_tokens / cpu_s, "cores_used": cpu_s / wall_s,
            "step_ms": 1e3 * wall_s / steps, "first_step_s": compile_s, "final_loss": float(metrics["loss"])}


def main() -> None:
    if "--sync" in sys.argv[1:]:
        from bench import learner_sync
        return learner_sync.main([a for a in sys.argv[1:] if a != "--sync"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=list(model.PRESETS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--quick", action="store_true", help="batch 16 only, 15 steps")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_throughput.json"))
    ap.add_argument("--sync", action="store_true", help="a learner's step time with syncing on against off, "
                    "with bench/learner_sync.py's options instead of these")
    args = ap.parse_args()
    if args.quick:
        args.batch_sizes, args.steps = [16], 15
    cfg = model.preset(args.preset)
    corpus = data.load_corpus(data.DataConfig())
    runs = []
    for bs in args.batch_sizes:
        r = measure(cfg, bs, args.steps, corpus.train)
        print(f"{args.preset} batch {bs}x{cfg.seq_len}: {r['tokens_per_s']:.0f} tokens/s, "
              f"{r['tokens_per_cpu_s']:.0f} tokens/cpu-s, {r['cores_used']:.2f} cores, "
              f"{r['step_ms']:.1f} ms/step, loss {r['final_loss']:.3f}", flush=True)
        runs.append(r)
    result = {
        "preset": args.preset, "param_count": model.param_count(model.abstract_params(cfg)),
        "seq_len": cfg.seq_len, "devices": [str(d) for d in jax.local_devices()],
        "cpu_count": os.cpu_count(), "machine": platform.machine(), "jax": jax.__version__,
        "load_avg_1min_at_end": os.getloadavg()[0], "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Codec benchmark: throughput, size and error of FragmentCodec on outer gradients.

Measures every bit width (fp32, bf16, int8, 4-bit) with and without zstd.
Writes bench/results/codec.json (schema from issue 3, plus a "tradeoffs" list
for the block size / codebook / scale dtype choices and a "targets" summary)
and bench/results/codec_tradeoffs.png. Runs on one CPU core (the process pins
itself) with data already on the device; throughput is the best of a few runs
after warm-up, in GB/s of fp32 input, next to the same run's np.copy.

    python bench/codec.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, before jax starts threads
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import numpy as np  # noqa: E402

from wan_diloco.compression import CodecConfig, FragmentCodec, quantize, quantize_pallas  # noqa: E402
from wan_diloco.compression.blocks import resolve_impl  # noqa: E402
from wan_diloco.fragments import Layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"
IMPLS = {"jnp": "jnp", "pallas_interpret": "pallas"}


# --------------------------------------------------------- outer gradients
def capture_outer_grads(quick: bool) -> dict[str, np.ndarray]:
    """Real outer gradients: the Δ = Θ_base − θ that learners upload in a simulated run.

    Two learners train the tiny transformer on the stdlib corpus (decoupled,
    H = 8, P = 4); the syncer's input is recorded, keeping each learner's
    latest upload of every tensor (mid-to-late training, not init).
    """
    from wan_diloco import sim, spec as spec_lib

    s = spec_lib.from_document({"run": {"learners": 2, "steps": 48 if quick else 160, "eval_batches": 1},
                                "simulate": {"curve_every_steps": 10_000}})
    captured: dict[str, np.ndarray] = {}

    def record(msg):
        for name, delta in msg.delta.items():
            captured[f"learner_{msg.learner}/{name}"] = np.array(delta, dtype=np.float32)

    sim.run(s, on_upload=record)
    return captured


def codec_for(frag: dict, cfg: CodecConfig) -> FragmentCodec:
    """A codec whose layout is ``frag`` as one fragment."""
    return FragmentCodec(cfg, Layout([tuple(frag)], {k: v.shape for k, v in frag.items()}))


# ---------------------------------------------------------------- measure
def best_seconds(fn, reps: int) -> float:
    """Best wall time of ``reps`` runs after a warm-up run (which compiles)."""
    return best_wall_and_cpu(fn, reps)[0]


def best_wall_and_cpu(fn, reps: int) -> tuple[float, float]:
    """Best wall and best CPU time (all threads of this process) of ``reps`` runs.

    On a shared machine the wall time includes waiting for the core; the CPU
    time is what the work itself costs on the one core it is pinned to.
    """
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return min(wall), min(cpu)


def rel_l2(decoded: dict, ref: dict) -> float:
    num = sum(float(np.sum((decoded[k].astype(np.float64) - ref[k]) ** 2)) for k in ref)
    den = sum(float(np.sum(ref[k].astype(np.float64) ** 2)) for k in ref)
    return (num / den) ** 0.5


def measure(frag_np, frag_dev, n_bytes, cfg: CodecConfig, reps: int) -> dict:
    codec = codec_for(frag_np, cfg)
    data = codec.encode(frag_dev)
    enc_s, enc_cpu_s = best_wall_and_cpu(lambda: codec.encode(frag_dev), reps)
    dec_s, dec_cpu_s = best_wall_and_cpu(lambda: codec.decode(0, data), reps)
    return {"encode_gbps": n_bytes / enc_s / 1e9, "decode_gbps": n_bytes / dec_s / 1e9,
            "encode_cpu_gbps": n_bytes / enc_cpu_s / 1e9, "decode_cpu_gbps": n_bytes / dec_cpu_s / 1e9,
            "ratio_vs_fp32": n_bytes / len(data), "ratio_vs_bf16": n_bytes / 2 / len(data),
            "rel_l2_error": rel_l2(codec.decode(0, data), frag_np), "encoded_bytes": len(data)}


def quantize_only_gbps(frag_dev, n_bytes, cfg: CodecConfig, reps: int) -> float:
    """Device-side quantize of every tensor (no host assembly, no zstd)."""
    fn = quantize if resolve_impl(cfg.impl) == "jnp" else quantize_pallas
    kw = dict(bits=cfg.bits, block_size=cfg.block_size, scale_dtype=cfg.scale_dtype,
              codebook=cfg.int4_codebook)
    seconds = best_seconds(lambda: jax.block_until_ready([fn(x, **kw) for x in frag_dev.values()]), reps)
    return n_bytes / seconds / 1e9


def datasets(n: int, quick: bool) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return {"gaussian": {"x": rng.standard_normal(n, dtype=np.float32)},
            "student_t3": {"x": rng.standard_t(3, n).astype(np.float32)},
            "outer_grad": capture_outer_grads(quick)}


def tradeoffs(sets) -> list[dict]:
    rows = []
    for data in ("gaussian", "student_t3", "outer_grad"):
        frag = sets[data]
        n_bytes = 4 * sum(v.size for v in frag.values())
        grid = [(8, "nf4", b, "bfloat16") for b in (64, 128, 256)]
        grid += [(4, cb, b, "bfloat16") for cb in ("nf4", "uniform") for b in (32, 64, 128, 256)]
        grid += [(bits, "nf4", 128, "float16") for bits in (8, 4)]
        for bits, cb, bs, sd in grid:
            cfg = CodecConfig(bits=bits, block_size=bs, int4_codebook=cb, scale_dtype=sd, impl="jnp")
            codec = codec_for(frag, cfg)
            data_bytes = codec.encode(frag)
            rows.append({"data": data, "bits": bits, "codebook": cb if bits == 4 else None, "block_size": bs,
                         "scale_dtype": sd, "ratio_vs_fp32": n_bytes / len(data_bytes),
                         "rel_l2_error": rel_l2(codec.decode(0, data_bytes), frag)})
    return rows


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {("nf4", "bfloat16"): "o", ("uniform", "bfloat16"): "s", ("nf4", "float16"): "^"}
    for (cb, sd), marker in markers.items():
        for data, color in {"gaussian": "C0", "student_t3": "C1", "outer_grad": "C2"}.items():
            pts = [r for r in rows if r["bits"] == 4 and r["codebook"] == cb and r["scale_dtype"] == sd
                   and r["data"] == data]
            ax.plot([r["ratio_vs_fp32"] for r in pts], [100 * r["rel_l2_error"] for r in pts], marker,
                    color=color, ls="-" if len(pts) > 1 else "",
                    label=f"{data} {cb} {'bf16' if sd == 'bfloat16' else 'fp16'} scale")
            for r in pts:
                ax.annotate(str(r["block_size"]), (r["ratio_vs_fp32"], 100 * r["rel_l2_error"]), fontsize=7)
    ax.axhline(10, color="gray", ls=":")
    ax.axvline(8, color="gray", ls=":")
    ax.set_xlabel("size reduction vs fp32 (with zstd)")
    ax.set_ylabel("relative L2 error (%)")
    ax.set_title("4-bit codecs: error vs size (labels: block size)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M values, fewer repetitions (under a minute)")
    args = ap.parse_args()
    n, reps = (1 << 20, 3) if args.quick else (1 << 23, 5)
    sets = datasets(n, args.quick)
    x = sets["gaussian"]["x"]
    memcpy_gbps = x.nbytes / best_seconds(lambda: np.copy(x), reps * 2) / 1e9
    results = []
    for data, frag in sets.items():
        frag_dev = {k: jax.device_put(v) for k, v in frag.items()}
        n_bytes = 4 * sum(v.size for v in frag.values())
        for bits in (32, 16, 8, 4):
            # The quantizer implementation only matters for the quantized widths.
            for impl, cfg_impl in (IMPLS.items() if bits in (8, 4) else [("jnp", "jnp")]):
                q_gbps = (quantize_only_gbps(frag_dev, n_bytes, CodecConfig(bits=bits, impl=cfg_impl), reps)
                          if bits in (8, 4) else None)
                for zstd in (True, False):
                    cfg = CodecConfig(bits=bits, zstd=zstd, impl=cfg_impl)
                    row = {"bits": bits, "impl": impl, "data": data, "zstd": zstd, "n_values": n_bytes // 4,
                           **measure(frag, frag_dev, n_bytes, cfg, reps), "quantize_gbps": q_gbps}
                    results.append(row)
                    print(f"{data:10s} {bits:2d}-bit {impl:16s} zstd={zstd!s:5s} enc {row['encode_gbps']:6.2f} "
                          f"(cpu {row['encode_cpu_gbps']:6.2f}) dec {row['decode_gbps']:6.2f} GB/s  "
                          f"x{row['ratio_vs_fp32']:5.2f} vs fp32  err {100 * row['rel_l2_error']:6.2f}%",
                          flush=True)
    trade = tradeoffs(sets)
    OUT.mkdir(parents=True, exist_ok=True)
    plot(trade, OUT / "codec_tradeoffs.png")

    def pick(**kw):
        return [r for r in results if all(r[k] == v for k, v in kw.items())]
    og4 = pick(bits=4, data="outer_grad", zstd=True, impl="jnp")[0]
    og8 = pick(bits=8, data="outer_grad", zstd=True, impl="jnp")[0]
    quantized = [r for r in pick(impl="jnp", zstd=True) if r["bits"] in (8, 4)]
    targets = {
        "jnp_encode_gbps_min_2": min(r["encode_gbps"] for r in quantized),
        "jnp_encode_cpu_gbps_min_2": min(r["encode_cpu_gbps"] for r in quantized),
        "jnp_quantize_gbps_min_2": min(r["quantize_gbps"] for r in quantized),
        "fp32_encode_gbps": min(r["encode_gbps"] for r in pick(bits=32, zstd=False)),
        "fp32_decode_gbps": min(r["decode_gbps"] for r in pick(bits=32, zstd=False)),
        "int4_zstd_ratio_outer_grad_min_8": og4["ratio_vs_fp32"],
        "int4_zstd_ratio_gaussian_min_8":
            pick(bits=4, data="gaussian", zstd=True, impl="jnp")[0]["ratio_vs_fp32"],
        "int8_error_outer_grad_max_0.01": og8["rel_l2_error"],
        "int4_error_outer_grad_max_0.10": og4["rel_l2_error"],
    }
    doc = {"memcpy_gbps": memcpy_gbps, "quick": args.quick,
           "cpu_cores": 1, "jax_backend": jax.default_backend(),
           "defaults": {k: getattr(CodecConfig(), k) for k in ("block_size", "scale_dtype", "int4_codebook",
                                                                 "zstd_level")},
           "notes": "FragmentCodec.encode / .decode on the whole dataset as one fragment. encode_gbps includes "
                    "quantize, packing, zstd and the header; quantize_gbps is the device quantizer alone (bits "
                    "8/4); decode is the host numpy decoder every process uses (fp32 without zstd: views); "
                    "*_cpu_gbps divide by this process's CPU time instead of wall time (the machine is shared, "
                    "so wall time includes waiting for the core). A zstd row whose frame would not be smaller "
                    "stores the raw bytes.",
           "results": results, "targets": targets, "tradeoffs": trade}
    (OUT / "codec.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"memcpy {memcpy_gbps:.2f} GB/s")
    print(json.dumps(targets, indent=1))


if __name__ == "__main__":
    main()

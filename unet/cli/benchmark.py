"""Speed and memory side by side: our attention block vs diffusers', capture overhead and memory,
sampling and training throughput, and how close to this machine's matmul peak we run.

    python scripts/benchmark.py            # full (about 10 min on 2 cores)
    python scripts/benchmark.py --quick    # under 3 min
"""

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from unet.cli import UsageError, add_model_argument, usage_error
from unet.eval.benchmark import run_benchmark
from unet.pipeline import load_pipeline, model_label


def table(r: dict) -> str:
    lines = ["| measure | value | target |", "|---|---|---|"]
    for size, ratio in r["block_vs_diffusers_fused"].items():
        lines.append(f"| block fused, ours/diffusers time, {size} (fwd) | {ratio:.2f}× | ≤ 1.0× |")
        fb = r["block"][size]["forward_backward"]["fused"]["median_ratio"]
        lines.append(f"| block fused, ours/diffusers time, {size} (fwd+bwd) | {fb:.2f}× | ≤ 1.0× |")
    for size, ratio in r["block_vs_diffusers_weights"].items():
        lines.append(f"| block with weights, ours/diffusers explicit, {size} (fwd) | {ratio:.2f}× | ≤ 1.3× |")
        fb = r["block"][size]["forward_backward"]["weights"]["median_ratio"]
        lines.append(f"| block with weights, ours/diffusers explicit, {size} (fwd+bwd) | {fb:.2f}× | ≤ 1.3× |")
    lines.append(f"| capture overhead (with/without store) | {r['capture_overhead']:.3f}× | ≤ 1.05× |")
    for steps, v in r["capture_bytes_by_steps"].items():
        lines.append(f"| store bytes after {steps} steps (every-step storage) | {v['store_bytes']:,} "
                     f"({v['every_step_bytes']:,}) | constant |")
    for bs, v in r["sampling_images_per_s"].items():
        steps = r["settings"]["sampling_steps"]
        lines.append(f"| sampling images/s, batch {bs}, {steps} steps, guidance | {v:.2f} | |")
    lines.append(f"| 8 images sampled in | {r['sampling']['8']['seconds']:.2f} s | ≤ 10 s (25 steps) |")
    lines.append(f"| training images/s | {r['training_images_per_s']:.1f} | |")
    rec = r.get("recipe")
    if rec:
        if "training" in rec:  # a scenes-32 model: the previous architecture is of its world
            tr, sa = rec["training"], rec["sampling_8"]
            lines.append(f"| training images/s, today / previous architecture (side by side) | "
                         f"{tr['images_per_s_now']:.1f} / {tr['images_per_s_before']:.1f} = {tr['speedup']:.2f}× "
                         f"| ≥ 2× |")
            lines.append(f"| 8 images × {r['settings']['sampling_steps']} steps, today / previous architecture | "
                         f"{sa['seconds_now']:.2f} s / {sa['seconds_before']:.2f} s | ≤ 3 s |")
        dp = rec["dpm10_vs_ddim"]
        lines.append(f"| 8 images, DPM-Solver++ 10 steps / DDIM {r['settings']['sampling_steps']} steps | "
                     f"{dp['seconds_dpm10']:.2f} s / {dp['theirs_ms'] / 1e3:.2f} s | |")
        own = rec["own_guidance_vs_4"]
        lines.append(f"| 8 images × {r['settings']['sampling_steps']} steps at the model's own guidance "
                     f"({own['guidance']:g}) / guidance 4 | {own['seconds_own']:.2f} s / "
                     f"{own['theirs_ms'] / 1e3:.2f} s | ≤ 3 s |")
    lines.append(f"| U-Net forward GFLOP/image | {r['unet_gflop_per_image_forward']:.3f} | |")
    lines.append(f"| sampling GFLOP/s / matmul peak GFLOP/s | {r['sampling_gflops']:.1f} / "
                 f"{r['matmul_peak_gflops']:.1f} = {r['fraction_of_matmul_peak']:.2f} | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(p)
    p.add_argument("--out", default=None, help="folder for bench.json and bench.md (default: outputs/bench/<date>)")
    p.add_argument("--quick", action="store_true", help="fewer repeats and steps, no SD-sized block")
    p.add_argument("--device", default=None, help="torch device (default cpu)")
    args = p.parse_args(argv)
    try:
        pipe = load_pipeline(args.model, device=args.device)
    except UsageError as e:
        return usage_error(e)
    result = run_benchmark(pipe, quick=args.quick, log=lambda m: print(m, file=sys.stderr))
    result["machine"] = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                         "torch": torch.__version__, "threads": torch.get_num_threads(),
                         "device": str(pipe.device)}
    result["model"] = model_label(args.model)
    result["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    out = Path(args.out) if args.out else Path("outputs/bench") / datetime.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    (out / "bench.md").write_text(text + "\n")
    print(text)
    print(f"\nwritten: {out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""fp32 GEMMs on CPU, torch's (MKL) beside rlhf's (`rlhf.platform.gemm`: oneDNN, the token dimension padded),
one process, one torch thread unless `--threads`: SmolLM2-135M's and the tiny model's linears at a micro-batch's
token count, forward (x W^T), dgrad (g W) and wgrad (W' += g^T x), the transposed operands as strided views.
Prints GFLOP/s and rlhf / torch per shape, writes benchmarks/results/gemm.json."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info  # noqa: E402

from rlhf.platform import gemm  # noqa: E402
from rlhf.profiling.ops import median_seconds  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gemm.json"
# (name, k, n): SmolLM2-135M's qkv, out, fc1, fc2 and LM head; the tiny Qwen2's qkv and fc1
SHAPES = [("smollm2 qkv", 576, 960), ("smollm2 out", 576, 576), ("smollm2 fc1", 576, 3072),
          ("smollm2 fc2", 1536, 576), ("smollm2 head", 576, 49152), ("tiny qkv", 64, 128), ("tiny fc1", 64, 256)]


def bench_shape(name: str, k: int, n: int, rows: int, repeats: int) -> dict:
    x, weight, grad = torch.randn(rows, k), torch.randn(n, k), torch.randn(rows, n)
    main_grad = torch.zeros(n, k)
    arms = {
        "forward": (lambda: torch.nn.functional.linear(x, weight), lambda: gemm.linear(x, weight)),
        "dgrad": (lambda: grad @ weight, lambda: gemm.matmul(grad, weight)),
        "wgrad": (lambda: main_grad.addmm_(grad.t(), x), lambda: gemm.add_weight_grad_(main_grad, grad, x)),
    }
    flops = 2 * rows * k * n
    row = {"name": name, "rows": rows, "k": k, "n": n, "padded_rows": gemm.padded_rows(rows)}
    for direction, (torch_fn, rlhf_fn) in arms.items():
        torch_s, rlhf_s = (median_seconds(fn, repeats, warmup=True) for fn in (torch_fn, rlhf_fn))
        row[direction] = {"torch_gflop_s": flops / torch_s / 1e9, "rlhf_gflop_s": flops / rlhf_s / 1e9,
                          "rlhf_over_torch": torch_s / rlhf_s}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[375, 1221], help="token counts (micro-batches)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        rows = [bench_shape(name, k, n, count, args.repeats) for count in args.rows for name, k, n in SHAPES]
    print(f"{'shape':14s} {'rows':>5s}  " + "  ".join(f"{d:>22s}" for d in ("forward", "dgrad", "wgrad")))
    for row in rows:
        cells = [f"{row[d]['torch_gflop_s']:5.0f} -> {row[d]['rlhf_gflop_s']:5.0f} {row[d]['rlhf_over_torch']:5.2f}x"
                 for d in ("forward", "dgrad", "wgrad")]
        print(f"{row['name']:14s} {row['rows']:5d}  " + "  ".join(f"{c:>22s}" for c in cells))
    ratios = [row[d]["rlhf_over_torch"] for row in rows for d in ("forward", "dgrad", "wgrad")]
    result = {"name": "gemm", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "machine": machine_info(), "onednn": gemm.ENABLED, "min_macs": gemm.MIN_MACS, "rows": rows,
              "summary": {"rlhf_over_torch_median": statistics.median(ratios), "rlhf_over_torch_min": min(ratios)}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()

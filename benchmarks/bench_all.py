"""Run every CPU benchmark (each writes benchmarks/results/<name>.json) and print one summary table.

`--quick` runs the small settings only (tiny models, smaller collective sizes); `--skip NAME` leaves one out.
A benchmark that fails is reported in the table and the others still run; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# name -> (script, full arguments, --quick arguments)
BENCHMARKS = {
    "collectives": ("bench_collectives.py", [], ["--sizes", "50", "500", "--repeats", "3"]),
    "reshard": ("bench_reshard.py", [], []),
    "engine": ("bench_engine.py", [], []),
    "gemm": ("bench_gemm.py", [], ["--rows", "375", "--repeats", "3"]),
    "rollout": ("bench_rollout.py", [], ["--models", "tiny", "--repeats", "3"]),
    "e2e": ("bench_e2e_vs_trl.py", [], []),
    "memphase": ("bench_memphase.py", [], []),
    "packing": ("bench_packing.py", [], ["--model", "tiny"]),
    "exchange": ("bench_exchange.py", [], ["--repeats", "3"]),
    "checkpoint": ("bench_checkpoint.py", [], ["--repeats", "1"]),
    "async": ("bench_async.py", [], ["--shapes", "tiny", "--steps", "6", "--curve-steps", "8"]),
    "multiturn": ("bench_multiturn.py", [], ["--steps", "4", "--warmup", "1"]),
    "e2e_smollm2": ("bench_e2e_vs_trl.py", ["--model", "smollm2", "--rounds", "3", "--steps-per-round", "1"], None),
}
RESULT_FILE = {"e2e_smollm2": "e2e"}


def run_one(name: str, quick: bool) -> str:
    script, full, short = BENCHMARKS[name]
    args = short if quick else full
    if args is None:
        return "skipped (--quick)"
    done = subprocess.run([sys.executable, str(HERE / script), *args], cwd=HERE.parent)
    return "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"


def summary_rows(names: list[str]) -> list[tuple[str, str, float]]:
    rows = []
    for name in dict.fromkeys(RESULT_FILE.get(n, n) for n in names):
        path = HERE / "results" / f"{name}.json"
        if path.exists():
            summary = json.loads(path.read_text()).get("summary", {})
            rows += [(name, key, value) for key, value in summary.items() if isinstance(value, (int, float))]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip", nargs="*", default=[], choices=list(BENCHMARKS))
    args = parser.parse_args()
    names = [name for name in BENCHMARKS if name not in args.skip]
    status = {name: run_one(name, args.quick) for name in names}
    print(f"\n{'benchmark':14} {'summary key':36} {'value':>12}")
    for bench, key, value in summary_rows(names):
        print(f"{bench:14} {key:36} {value:12.4g}")
    for name, state in status.items():
        print(f"{name:14} {state}")
    return 0 if all(not s.startswith("failed") for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

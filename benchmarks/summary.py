"""One table of every benchmark's headline figures (the `summary` of each benchmarks/results/<name>.json)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        for key, value in result.get("summary", {}).items():
            rows.append((result.get("name", path.stem), key, value, result.get("date", "")))
    if not rows:
        print(f"no results under {RESULTS}; run `make bench-<name>` first")
        return 1
    width = max(len(r[1]) for r in rows)
    print(f"{'benchmark':<12} {'figure':<{width}} {'value':>12}  date")
    for name, key, value, date in rows:
        shown = f"{value:.3f}" if isinstance(value, (int, float)) else str(value)
        print(f"{name:<12} {key:<{width}} {shown:>12}  {date}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Device-specific code lives behind one door: rlhf/platform/. Nothing else may name CUDA or NCCL."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATTERN = re.compile(r"""\.cuda\(|["']cuda["']|["']nccl["']|device=["']cuda|torch\.cuda\.""")


def test_no_device_special_casing_outside_the_platform_door():
    offenders = []
    for folder in ("rlhf", "kernels", "benchmarks", "launch"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("rlhf", "platform"):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if PATTERN.search(line):
                    offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "device-specific code outside rlhf/platform/:\n" + "\n".join(offenders)

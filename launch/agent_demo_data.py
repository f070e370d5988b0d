"""The tool-use demo's data (`make demo-agent`): multiplications of a 3-digit by a 2-digit number, too long for
a tiny char model to do in its head, which a calculator tool does exactly.

Writes into OUT: `rl.jsonl` and `val.jsonl` (prompts with the product as ground truth, disjoint), and
`sft.jsonl`, the SFT policy's records in three kinds: a first turn that calls the calculator (`--call-share` of
the first turns), a first turn that answers directly (the rest), and a second turn that copies the calculator's
result, read from the tool message, into the answer. `--system` puts a system turn before every RL and held-out
prompt (a real chat model told how to call the tool: configs/recipes/agent_smollm2_calculator.sh).
Usage: python launch/agent_demo_data.py OUT [--sft N] [--system TEXT]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SOURCE = "tool/multiply"


def call_text(expression: str) -> str:
    """The assistant's tool call, as the policy is taught to write it (compact JSON)."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def problems(rng: random.Random, count: int, exclude: set[str]) -> list[tuple[str, str]]:
    out = []
    while len(out) < count:
        expression = f"{rng.randint(100, 999)}*{rng.randint(10, 99)}"
        if expression not in exclude:
            exclude.add(expression)
            out.append((expression, str(eval(expression))))  # noqa: S307 (two integer literals)
    return out


def record(messages: list[dict], answer: str) -> dict:
    return {"prompt": messages, "data_source": SOURCE, "reward_model": {"ground_truth": answer}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--sft", type=int, default=8000, help="SFT problems (one or two records each)")
    parser.add_argument("--call-share", type=float, default=0.3, help="share of SFT first turns that call the tool")
    parser.add_argument("--copy-records", type=int, default=6000, help="second-turn (copy the result) SFT records")
    parser.add_argument("--rl", type=int, default=4000)
    parser.add_argument("--val", type=int, default=256)
    parser.add_argument("--system", default="", help="a system turn before every RL and held-out prompt")
    args = parser.parse_args()
    system = [{"role": "system", "content": args.system}] if args.system else []
    rng, seen = random.Random(0), set()
    val, rl = problems(rng, args.val, seen), problems(rng, args.rl, seen)
    sft_problems = problems(rng, args.sft, seen)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, (expression, answer) in enumerate(sft_problems):
        user = [{"role": "user", "content": expression}]
        rows.append(record(user, call_text(expression) if rng.random() < args.call_share else answer))
        if index < args.copy_records:
            called = user + [{"role": "assistant", "content": call_text(expression)},
                             {"role": "tool", "content": answer}]
            rows.append(record(called, answer))
    rng.shuffle(rows)
    prompts = {name: [record(system + [{"role": "user", "content": e}], a) for e, a in problems_]
               for name, problems_ in (("rl", rl), ("val", val))}
    for name, data in (("sft", rows), ("rl", prompts["rl"]), ("val", prompts["val"])):
        with open(args.out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in data)
    print(f"{args.out}: {len(rows)} SFT records, {len(rl)} RL prompts, {len(val)} held-out prompts")


if __name__ == "__main__":
    main()

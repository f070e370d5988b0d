"""The native sampler's cost per decode step for each filter, on SmolLM2-135M's own next-token distributions.

Logits: `transformers.generate` of SmolLM2-135M-Instruct (fp32, unfiltered sampling at T=1) on a few chat prompts,
every step's full-vocabulary logits kept; 32 rows drawn from them (a decode batch). Random logits would be far
flatter than a language model's, so the top-p nucleus sizes are reported too. `--baseline DIR`: also time
`DIR/rlhf/rollout/native/sampler.py` (another checkout), interleaved, and check both draw the same tokens.
Process CPU time (one thread), medians; writes benchmarks/results/sampler.json.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import resource
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info  # noqa: E402

from rlhf.rollout.sampling_params import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "sampler.json"
PROMPTS = ("What is 17 times 23? Think step by step.", "Write a short poem about the sea.",
           "Explain why the sky is blue.", "Natalia sold clips to 48 of her friends in April, and then she sold half "
           "as many clips in May. How many clips did Natalia sell altogether in April and May?")
CASES = {"T=1": {}, "T=0.7": {"temperature": 0.7}, "top_k=50": {"top_k": 50}, "top_p=0.9": {"top_p": 0.9},
         "top_p=0.95,T=0.7": {"top_p": 0.95, "temperature": 0.7}, "top_k=50,top_p=0.9": {"top_k": 50, "top_p": 0.9}}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def model_logits(new_tokens: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.models.smollm2 import smollm2_hf_folder

    path = str(smollm2_hf_folder())
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    rows = []
    torch.manual_seed(0)
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 output_logits=True, return_dict_in_generate=True)
        rows.extend(step[0].float() for step in out.logits)
    return torch.stack(rows)


def nucleus_sizes(logits: torch.Tensor, top_p: float) -> dict:
    cumulative = torch.softmax(logits, -1).sort(dim=-1, descending=True).values.cumsum(-1)
    sizes = sorted(((cumulative < top_p).sum(-1) + 1).tolist())
    return {"median": sizes[len(sizes) // 2], "p90": sizes[int(0.9 * len(sizes))], "max": sizes[-1]}


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--baseline", default=None, help="another checkout whose sampler is timed beside this one")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    logits = model_logits(args.new_tokens)
    batch = logits[torch.randperm(len(logits), generator=torch.Generator().manual_seed(0))[:args.rows]].contiguous()
    sides = {"current": _load(Path(__file__).resolve().parents[1] / "rlhf/rollout/native/sampler.py", "current")}
    if args.baseline:
        sides["baseline"] = _load(Path(args.baseline) / "rlhf/rollout/native/sampler.py", "baseline")
    loads, results = [os.getloadavg()[0]], {}
    for name, fields in CASES.items():
        params = SamplingParams(max_new_tokens=2, **({"temperature": 1.0} | fields))
        times: dict[str, list[float]] = {side: [] for side in sides}
        for repeat in range(args.repeats):
            for side in (list(sides) if repeat % 2 == 0 else list(sides)[::-1]):
                generator = torch.Generator().manual_seed(repeat)
                sides[side].sample(batch, params, generator)
                start = cpu_seconds()
                for _ in range(5):
                    sides[side].sample(batch, params, generator)
                times[side].append(1e3 * (cpu_seconds() - start) / 5)
        row = {f"{side}_ms": statistics.median(values) for side, values in times.items()}
        if args.baseline:
            drawn = [sides[side].sample(batch, params, torch.Generator().manual_seed(9)) for side in sides]
            row |= {"speedup": row["baseline_ms"] / row["current_ms"],
                    "same_tokens": bool(torch.equal(drawn[0].tokens_k, drawn[1].tokens_k))}
        results[name] = row
        loads.append(os.getloadavg()[0])
        print(name, {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    nuclei = {str(p): nucleus_sizes(logits, p) for p in (0.9, 0.95, 0.99)}
    print("nucleus sizes over", len(logits), "steps:", nuclei)
    result = {"name": "sampler", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info() | {"load_avg_1m": loads},
              "config": {k: v for k, v in vars(args).items() if k != "out"}, "cases_ms": results,
              "nucleus_sizes": nuclei}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

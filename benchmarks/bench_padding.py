"""Actor update on variable-length responses: length-sorted, trimmed micro-batches vs the padded baseline.

One rank, one actor (`PolicyRole.update`), a fixed batch of 32 rows whose response lengths are uniform in
[1, 128] after a 6-token prompt, micro-batches of 8. Three variants of the same code, alternating repeats:
`padded` (every micro-batch at the step's width, what rlhf did before), `trimmed` (each micro-batch cut to its
longest row) and `sorted` (rows sorted by length first, then trimmed; the default). Reports median s/update and
padded ÷ variant; writes benchmarks/results/padding.json. `--model tiny` runs in seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "padding.json"
ROWS, PROMPT, MAX_RESPONSE = 32, 6, 128


def variable_length_batch(vocab: int):
    from rlhf.stages.batch import ScoredBatch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, MAX_RESPONSE + 1, (ROWS,), generator=gen)
    mask = torch.arange(MAX_RESPONSE)[None] < lengths[:, None]
    zeros_bt = torch.zeros(mask.shape)
    return ScoredBatch(tokens_bs=torch.randint(3, vocab, (ROWS, PROMPT + MAX_RESPONSE), generator=gen),
                       prompt_lengths_b=torch.full((ROWS,), PROMPT), response_lengths_b=lengths,
                       response_mask_bt=mask, loss_mask_bt=mask, group_index_b=torch.arange(ROWS) // 4,
                       sample_index_b=torch.arange(ROWS) // 4, trajectory_index_b=None,
                       rollout_logprobs_bt=zeros_bt,
                       policy_version_bt=torch.zeros(mask.shape, dtype=torch.int32),
                       truncated_b=torch.zeros(ROWS, dtype=torch.bool), scores_b=torch.zeros(ROWS),
                       baseline_scores_b=None, routed_experts_bslk=None, pad_token_id=0, old_logprobs_bt=None,
                       ref_logprobs_bt=None, values_bt=None, token_rewards_bt=zeros_bt,
                       advantages_bt=torch.randn(mask.shape, generator=gen) * mask, returns_bt=None,
                       is_weights_bt=None, teacher_logprobs_bt=None,
                       cov_selected_bt=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    from transformers import AutoConfig

    import rlhf.stages.roles as roles
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.parallel.meshes import RoleMesh
    from rlhf.testing.distributed import free_port
    from rlhf.train.config import OptimConfig
    from rlhf.stages.config import AlgoConfig, UpdateConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as workdir:
        if args.model == "smollm2":
            from rlhf.models.smollm2 import smollm2_hf_folder

            path = str(smollm2_hf_folder())
        else:
            from bench_e2e_vs_trl import tiny_model_folder

            path = tiny_model_folder(Path(workdir))
        layout = ParallelLayout()
        role = roles.PolicyRole("actor", RoleMesh("actor", layout, build_layout_groups(layout)), path,
                                total_steps=1000, update=UpdateConfig(micro_batch_size=args.micro_batch,
                                                                      optim=OptimConfig(lr=1e-6)))
        batch = variable_length_batch(AutoConfig.from_pretrained(path).vocab_size)
        sorted_order, trimmed_split = roles.by_length, roles.PolicyRole._micro_batches
        variants = {
            "sorted": (sorted_order, trimmed_split),
            "trimmed": (lambda b: torch.arange(b.size), trimmed_split),
            "padded": (lambda b: torch.arange(b.size), lambda self, shard, size: shard.chunks(size)),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, (order, split) in variants.items():
                roles.by_length, roles.PolicyRole._micro_batches = order, split
                start = time.perf_counter()
                role.update(batch, AlgoConfig())
                if repeat:
                    times[name].append(time.perf_counter() - start)
        roles.by_length, roles.PolicyRole._micro_batches = sorted_order, trimmed_split
    median = {name: statistics.median(values) for name, values in times.items()}
    real = int((batch.prompt_lengths_b + batch.response_lengths_b).sum())
    summary = {f"padded_over_{name}": median["padded"] / median[name] for name in ("sorted", "trimmed")}
    print(f"{'variant':8} {'s/update':>9} {'padded/variant':>15}")
    for name in variants:
        print(f"{name:8} {median[name]:9.3f} {median['padded'] / median[name]:14.2f}x")
    print(f"tokens: {real} real of {ROWS * (PROMPT + MAX_RESPONSE)} padded")
    result = {"name": "padding", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "config": {**vars(args), "rows": ROWS, "prompt": PROMPT,
                                                     "max_response": MAX_RESPONSE, "real_tokens": real},
              "seconds": times, "median_s": median, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""On-policy distillation's signal checked by hand, outside rlhf (transformers only): is the sampled-token estimator
rlhf trains on a descent direction of the reverse KL?

The student samples `--prompts` x `--n` responses at temperature 1 (plain-text prompts, as
`rlhf.data.tokenize.encode_prompt`); at each response position t the logprob of token t+1 is read from the logits
at t (student and teacher on the same prefix). rlhf's actor loss at ratio 1 (one on-policy update, token-mean) is
`-mean_t A_t * logpi(x_t)` with `A_t = clip(teacher_t - student_t, +-clip)` detached; its gradient is compared
(cosine) with the gradient of the exact per-position reverse KL `sum_v pi(v) (log pi(v) - log q(v))` on the same
prefixes, and the exact KL is re-measured after a normalised SGD step along the estimator's descent direction.
Usage: python benchmarks/distill_signal_check.py STUDENT_DIR TEACHER_DIR PROMPTS.parquet [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def sample_groups(student, tokenizer, prompts: list[str], n: int, max_new_tokens: int) -> list[tuple]:
    """Per prompt: (prompt length, `[n, P + max_new_tokens]` ids, `[n, max_new_tokens]` mask up to the first EOS)."""
    eos, groups = tokenizer.eos_token_id, []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(tokenizer.encode(prompt))
            x = torch.tensor([ids] * n)
            for _ in range(max_new_tokens):
                x = torch.cat([x, torch.multinomial(student(x).logits[:, -1].softmax(-1), 1)], 1)
            is_eos = (x[:, len(ids):] == eos).long()
            groups.append((len(ids), x, (is_eos.cumsum(1) - is_eos) == 0))
    return groups


def position_logprobs(model, groups: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """(`[N, vocab]` log-softmax at each masked response position, `[N]` the sampled token there)."""
    logps, tokens = [], []
    for prompt_len, x, mask in groups:
        logp = model(x).logits[:, prompt_len - 1:-1].log_softmax(-1)  # position t predicts token t + 1
        logps.append(logp[mask])
        tokens.append(x[:, prompt_len:][mask])
    return torch.cat(logps), torch.cat(tokens)


def exact_reverse_kl(student, teacher, groups: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(student logprob of the sampled tokens, teacher's (detached), the exact reverse KL per position)."""
    student_v, tokens = position_logprobs(student, groups)
    with torch.no_grad():
        teacher_v, _ = position_logprobs(teacher, groups)
    sampled = lambda logp_v: logp_v.gather(1, tokens[:, None])[:, 0]  # noqa: E731
    return sampled(student_v), sampled(teacher_v), (student_v.exp() * (student_v - teacher_v)).sum(-1)


def check(student, teacher, groups: list[tuple], clip: float) -> dict[str, float]:
    params = list(student.parameters())
    flat = lambda grads: torch.cat([g.flatten() for g in grads])  # noqa: E731
    ls, lt, kl = exact_reverse_kl(student, teacher, groups)
    signal = lt - ls.detach()
    g_exact = flat(torch.autograd.grad(kl.mean(), params, retain_graph=True))
    result = {"tokens": float(ls.numel()), "sampled_reverse_kl": float(-signal.mean()),
              "exact_reverse_kl": float(kl.detach().mean()), "teacher_logprob": float(lt.mean()),
              "student_logprob": float(ls.detach().mean()),
              f"clip_fraction_at_{clip:g}": float((signal.abs() > clip).float().mean())}
    for name, advantage in (("clipped", signal.clamp(-clip, clip)), ("unclipped", signal)):
        g = flat(torch.autograd.grad(-(advantage * ls).mean(), params, retain_graph=True))
        result[f"cosine_{name}_vs_exact_grad"] = float(g @ g_exact / g.norm() / g_exact.norm())
        if name == "clipped":
            direction = g / g.norm()
    for size in (1e-2, 3e-2, 1e-1):  # a normalised SGD step along -estimator: the exact KL on these prefixes
        offsets = torch.split(direction, [p.numel() for p in params])
        with torch.no_grad():
            for p, d in zip(params, offsets):
                p -= size * d.view_as(p)
            result[f"exact_reverse_kl_after_step_{size:g}"] = float(exact_reverse_kl(student, teacher, groups)[2].mean())
            for p, d in zip(params, offsets):
                p += size * d.view_as(p)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("student")
    parser.add_argument("teacher")
    parser.add_argument("prompts")
    parser.add_argument("--prompts-count", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=5)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    student = AutoModelForCausalLM.from_pretrained(args.student).float()
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher).float().eval()
    prompts = [row["prompt"] for row in pq.read_table(args.prompts).to_pylist()[:args.prompts_count]]
    result = check(student, teacher, sample_groups(student, tokenizer, prompts, args.n, args.max_new_tokens),
                   args.clip)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

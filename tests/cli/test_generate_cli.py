"""`rlhf generate` end to end on 2 ranks (dp=2): JSONL rows in dataset order, greedy equal to transformers."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlhf.rollout.hf_engine import HFEngine
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import PromptBatch
from rlhf.testing.distributed import run_distributed
from rlhf.testing.tiny_models import tiny_hf_model

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +-=?"


def _save_char_tokenizer(path):
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{ch: i + 3 for i, ch in enumerate(ALPHABET)}}
    vocab.update({f"<extra{i}>": i for i in range(len(vocab), 101)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>")
    tokenizer.save_pretrained(path)
    return tokenizer


def _run_cli(argv):
    from rlhf.cli.main import main

    return main(argv)


def test_generate_writes_jsonl_in_dataset_order(tmp_path):
    model_dir, data, out = tmp_path / "model", tmp_path / "prompts.jsonl", tmp_path / "out" / "gen.jsonl"
    model = tiny_hf_model("llama", seed=2)
    model.save_pretrained(model_dir)
    tokenizer = _save_char_tokenizer(model_dir)
    prompts = ["1+2=", "what is 7-3?", "abc", "99+1=", "x"]
    with data.open("w") as f:
        for i, text in enumerate(prompts):
            f.write(json.dumps({"prompt": text, "data_source": "toy", "reward_model": {"ground_truth": str(i)}}) + "\n")
    argv = ["generate", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--temperature", "0",
            "--max-new-tokens", "5", "--batch-size", "2"]
    assert run_distributed(_run_cli, 2, argv, backend="none", timeout_s=180) == [0, 0]

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(5))
    assert [r["prompt"] for r in rows] == prompts and rows[3]["ground_truth"] == "3"
    token_lists = [tokenizer.encode(p) for p in prompts]
    expected = HFEngine(model, eos_token_ids=(2,)).generate(PromptBatch.from_token_lists(token_lists),
                                                            SamplingParams(max_new_tokens=5, temperature=0.0))
    for i, row in enumerate(rows):
        assert row["prompt_tokens"] == token_lists[i]
        assert row["tokens"] == expected.response(i)
        assert row["finish_reason"] == expected.finish_reasons[i].value
        assert len(row["logprobs"]) == len(row["tokens"]) and all(lp <= 0 for lp in row["logprobs"])
        assert row["response"] == tokenizer.decode(row["tokens"], skip_special_tokens=True)
        torch.testing.assert_close(torch.tensor(row["logprobs"]),
                                   expected.response_logprobs_rt[i, :len(row["tokens"])], atol=1e-5, rtol=0)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM: make install-vllm")
def test_generate_with_vllm_pushes_the_checkpoint_and_exits_cleanly(tmp_path):
    """Real vLLM starts from dummy weights: the CLI must push the folder's. Its exit must raise nothing (vLLM's
    teardown runs before rlhf ends the process group)."""
    model_dir, data, out = tmp_path / "model", tmp_path / "prompts.jsonl", tmp_path / "gen.jsonl"
    # head_dim 32: vLLM's CPU attention has no kernel for the default tiny model's 16
    model = tiny_hf_model("qwen2", seed=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
    model.save_pretrained(model_dir)
    _save_char_tokenizer(model_dir)
    prompts = ["1+2=", "what is 7-3?", "abc"]
    data.write_text("".join(json.dumps({"prompt": p, "data_source": "toy"}) + "\n" for p in prompts))
    proc = subprocess.run([sys.executable, "-m", "rlhf", "generate", "--model", str(model_dir), "--data", str(data),
                           "--out", str(out), "--engine", "vllm", "--temperature", "0", "--max-new-tokens", "6"],
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for sign in ("Invalid process group", "Exception ignored", "Error in atexit"):
        assert sign not in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    token_lists = [r["prompt_tokens"] for r in rows]  # as the CLI encodes them
    expected = HFEngine(model, eos_token_ids=(2,)).generate(PromptBatch.from_token_lists(token_lists),
                                                            SamplingParams(max_new_tokens=6, temperature=0.0))
    assert [r["tokens"] for r in rows] == [expected.response(i) for i in range(len(prompts))]
    for row in rows:
        tokens = torch.tensor([row["prompt_tokens"] + row["tokens"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(tokens).logits[0, len(row["prompt_tokens"]) - 1:-1], -1)
        torch.testing.assert_close(torch.tensor(row["logprobs"]),
                                   logprobs.gather(-1, tokens[0, len(row["prompt_tokens"]):, None])[:, 0],
                                   atol=1e-5, rtol=0)


def _run_cli_capturing(argv):
    import contextlib
    import io

    from rlhf.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def test_generate_reports_progress_and_the_scores_of_rewarded_data(tmp_path):
    """Outside a terminal a progress line per `--progress-every` batches; gsm8k rows get their rule-reward score."""
    model_dir, data, out = tmp_path / "model", tmp_path / "prompts.jsonl", tmp_path / "gen.jsonl"
    tiny_hf_model("llama", seed=2).save_pretrained(model_dir)
    _save_char_tokenizer(model_dir)
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "data_source": "openai/gsm8k",
                                        "reward_model": {"ground_truth": str(i + 1)}}) + "\n" for i in range(5)))
    argv = ["generate", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--temperature", "0",
            "--max-new-tokens", "3", "--batch-size", "2", "--progress-every", "1"]
    [(code, stdout)] = run_distributed(_run_cli_capturing, 1, argv, backend="none", timeout_s=180)
    lines = stdout.splitlines()
    assert code == 0 and len(lines) == 4
    for done, line in enumerate(lines[:3], 1):
        assert re.fullmatch(rf"generate \(batches of 2 prompts\): {done}/3 \({100 * done // 3}%\), \S+ elapsed, "
                            r"eta \S+", line), line
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(row["score"] in (0.0, 1.0) for row in rows)
    assert json.loads(lines[3]) == {"prompts": 5, "rollouts": 5, "out": str(out),
                                    "score/mean": sum(row["score"] for row in rows) / 5}

"""`rlhf data make` / `check` end to end through argparse: output, and one-line errors that write nothing."""

import argparse
import json

import pytest

from rlhf.cli.data import add_parser, run
from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.data.records import read_records


def invoke(*argv):
    parser = argparse.ArgumentParser(prog="rlhf")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["data", *argv]))


def test_make_writes_a_readable_dataset(tmp_path, capsys):
    out = tmp_path / "train.parquet"
    rc = invoke("make", "--task", "chain_sum", "--num-prompts", "4", "--out", str(out), "--seed", "9",
                "--prompt-format", "expression", "--task-option", "max_terms=3", "--task-option", "max_digits=2")
    assert rc == 0
    assert capsys.readouterr().out == f"wrote 4 prompts of reasoning-gym 'chain_sum' (seed 9) to {out}\n"
    records = read_records(out)
    assert len(records) == 4 and all(r.prompt.endswith("=") for r in records)
    assert records[0].extra_info["task_config"] == '{"max_digits": 2, "max_terms": 3}'


@pytest.mark.parametrize("argv, rc, message", [
    (["--task", "nope", "--num-prompts", "3"], 2, "unknown reasoning-gym task 'nope'"),
    (["--task", "chain_sum", "--num-prompts", "3", "--task-option", "oops"], 2, "task option 'oops' must be written key=value"),
    (["--task", "chain_sum", "--num-prompts", "3", "--exclude", "missing.jsonl"], 2, "missing.jsonl: dataset file not found"),
    (["--task", "chain_sum", "--num-prompts", "1", "--out", "x.csv"], 2, "--out 'x.csv' must end in one of .jsonl, .parquet"),
])
def test_make_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, argv, rc, message):
    monkeypatch.chdir(tmp_path)
    assert invoke("make", *argv, *([] if "--out" in argv else ["--out", "out.jsonl"])) == rc
    err = capsys.readouterr().err
    assert err.startswith("rlhf data make: error: ") and message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_make_with_malformed_exclude_file_names_its_line(tmp_path, capsys):
    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "data_source": "x"}) + "\n{oops\n")
    out = tmp_path / "held.jsonl"
    assert invoke("make", "--task", "chain_sum", "--num-prompts", "2", "--out", str(out), "--exclude", str(bad)) == 2
    assert capsys.readouterr().err == f"rlhf data make: error: {bad}:2: invalid JSON (Expecting property name " \
                                      "enclosed in double quotes at column 2)\n"
    assert not out.exists()


def test_check_summarises_and_tokenizes(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    invoke("make", "--task", "chain_sum", "--num-prompts", "5", "--out", str(data), "--prompt-format", "expression",
           "--task-option", "min_terms=2", "--task-option", "max_terms=2", "--task-option", "max_digits=1")
    build_char_tokenizer().save_pretrained(tmp_path / "tok")
    capsys.readouterr()
    assert invoke("check", str(data), "--tokenizer", str(tmp_path / "tok"), "--max-prompt-length", "4",
                  "--truncation", "filter") == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{data}: 5 prompts; data sources: reasoning_gym/chain_sum (5)",
        "prompt tokens: min 4, mean 4.0, max 4; kept 5, filtered 0, truncated 0 (max_prompt_length 4, filter)"]
    assert invoke("check", str(data), "--tokenizer", str(tmp_path / "tok"), "--max-prompt-length", "3") == 2
    err = capsys.readouterr().err
    assert err.startswith("rlhf data check: error: prompt index 0 (data_source='reasoning_gym/chain_sum') has 4 "
                          "tokens > data.max_prompt_length=3") and err.count("\n") == 1


def test_check_bad_tokenizer_folder(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1", "data_source": "x", "reward_model": {"ground_truth": "1"}}) + "\n")
    assert invoke("check", str(data), "--tokenizer", str(tmp_path / "nothing")) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_tasks_lists_what_make_writes(capsys):
    assert invoke("tasks") == 0
    names = capsys.readouterr().out.splitlines()
    assert len(names) == 100 and "gsm_symbolic" in names and "boxnet" not in names


def test_make_gsm_symbolic_past_five_prompts(tmp_path, capsys):
    """The quickstart's own command crashed on the 6th item (a Fraction in its metadata)."""
    out = tmp_path / "train.parquet"
    assert invoke("make", "--task", "gsm_symbolic", "--num-prompts", "30", "--out", str(out)) == 0
    assert capsys.readouterr().out == f"wrote 30 prompts of reasoning-gym 'gsm_symbolic' (seed 0) to {out}\n"
    assert len(read_records(out)) == 30

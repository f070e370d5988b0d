"""`rlhf data make` end to end through argparse: success output, and one-line errors that write nothing."""

import argparse

import pytest

from rlhf.cli.data import add_parser, run
from rlhf.data.records import read_records


def invoke(argv):
    parser = argparse.ArgumentParser(prog="rlhf")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["data", "make", *argv]))


def test_make_writes_a_readable_dataset(tmp_path, capsys):
    out = tmp_path / "train.parquet"
    rc = invoke(["--task", "chain_sum", "--n", "4", "--out", str(out), "--seed", "9",
                 "--prompt-format", "expression", "--task-option", "max_terms=3", "--task-option", "max_digits=2"])
    assert rc == 0
    assert capsys.readouterr().out == f"wrote 4 prompts of reasoning-gym 'chain_sum' (seed 9) to {out}\n"
    records = read_records(out)
    assert len(records) == 4 and all(r.prompt.endswith("=") for r in records)
    assert records[0].extra_info["task_config"] == '{"max_digits": 2, "max_terms": 3}'


@pytest.mark.parametrize("argv, rc, message", [
    (["--task", "nope", "--n", "3"], 2, "unknown reasoning-gym task 'nope'"),
    (["--task", "chain_sum", "--n", "3", "--task-option", "oops"], 2, "task option 'oops' must be written key=value"),
    (["--task", "chain_sum", "--n", "3", "--exclude", "missing.jsonl"], 1, "missing.jsonl: dataset file not found"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, argv, rc, message):
    monkeypatch.chdir(tmp_path)
    assert invoke([*argv, "--out", "out.jsonl"]) == rc
    err = capsys.readouterr().err
    assert err.startswith("rlhf data make: error: ") and message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_bad_output_suffix(tmp_path, capsys):
    assert invoke(["--task", "chain_sum", "--n", "1", "--out", str(tmp_path / "x.csv")]) == 2
    assert "must end in one of .jsonl, .parquet" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []

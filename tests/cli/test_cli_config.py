"""`rlhf config --print` shows the resolved tree a run would use; `--reference` prints the reference page, or
writes it to the path given."""

from __future__ import annotations

import yaml

from rlhf.cli.main import main
from rlhf.config import from_dict, load_config
from rlhf.orchestration.schema import RlhfConfig
from rlhf.config.reference import render


def test_print_is_the_resolved_config(capsys):
    args = ["--config", "configs/tiny_cpu.yaml", "mesh.rollout.tp=2", "actor.optim.lr=3e-6"]
    assert main(["config", "--print", *args]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert from_dict(RlhfConfig, printed) == load_config(RlhfConfig, args[1], args[2:])
    assert printed["mesh"]["rollout"]["tp"] == 2 and printed["sft"]["steps"] == 100  # defaults filled in


def test_print_names_a_bad_key(capsys):
    assert main(["config", "trainer.total_step=3"]) == 2
    assert capsys.readouterr().err == ("rlhf config: error: unknown config key 'trainer.total_step'; "
                                       "did you mean 'total_steps'?\n")


def test_reference_writes_the_page(tmp_path, capsys):
    out = tmp_path / "config.md"
    assert main(["config", "--reference", str(out)]) == 0
    assert out.read_text() == render(RlhfConfig) and capsys.readouterr().out == f"wrote {out}\n"


def test_reference_without_a_path_prints_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "--reference"]) == 0
    assert capsys.readouterr().out == render(RlhfConfig) and list(tmp_path.iterdir()) == []

"""Config loading: YAML + dotted overrides, unknown keys, type errors, round trip of the resolved config."""

import pytest

from rlhf.config import load_config, save_config, to_dict
from rlhf.orchestration.schema import RlhfConfig
from rlhf.config.loader import parse_override
from rlhf.errors import ConfigError


def test_yaml_plus_overrides(tmp_path):
    cfg = load_config(RlhfConfig, "configs/tiny_cpu.yaml",
                      ["mesh.rollout.tp=2", "comm.min_bucket_mb=4", "run.name=abc", "mesh.roles=[actor,rollout]"])
    assert cfg.mesh.rollout.tp == 2 and cfg.comm.min_bucket_mb == 4.0 and isinstance(cfg.comm.min_bucket_mb, float)
    assert cfg.run.name == "abc" and cfg.mesh.roles == ["actor", "rollout"] and cfg.dist.backend == "gloo"
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(RlhfConfig, tmp_path / "config.yaml") == cfg


def test_defaults_live_in_the_dataclasses():
    assert to_dict(load_config(RlhfConfig)) == to_dict(RlhfConfig())


@pytest.mark.parametrize("override, message", [
    ("mesh.rolout.tp=2", r"^unknown config key 'mesh\.rolout'; did you mean 'rollout'\?$"),
    ("comm.verfy=true", r"^unknown config key 'comm\.verfy'; did you mean 'verify'\?$"),
    ("zzz=1", r"^unknown config key .zzz.; known keys: actor, alerts, algo, checkpoint, comm, critic, data, dist, "
              r"lora, mesh, metrics, model, multiturn, ref, replay, reward, rollout, run, sampling, sft, trainer$"),
    ("mesh.rollout.tp=two", r"^mesh\.rollout\.tp='two' must be an integer$"),
    ("comm.verify=maybe", r"^comm\.verify='maybe' must be true or false$"),
    ("comm.strategy=fast", r"^comm\.strategy='fast' is not one of 'bucket', 'rs_ag', 'plain'$"),
    ("mesh.actor=3", r"^mesh\.actor must be a mapping of RoleLayoutConfig fields, got 3$"),
    ("mesh.actor.tp.x=3", r"^override 'mesh\.actor\.tp\.x=3': 'tp' is a value, not a section$"),
    ("dist.timeout_s=0", r"^dist\.timeout_s=0\.0 must be > 0 seconds$"),
    ("mesh.actor.tp", r"^override 'mesh\.actor\.tp' must look like section\.key=value"),
    ("comm.weight_sync_method=nccl", r"^comm\.weight_sync_method='nccl' is not one of 'auto', 'shm', 'p2p', "
                                     r"'all_to_all'$"),
    ("comm.weight_sync_bucket_mb=-1", r"^comm\.weight_sync_bucket_mb=-1\.0 must be >= 0 \(0: the platform default\)$"),
    ("ref.micro_batch_size=0", r"^ref\.micro_batch_size=0 must be >= 1$"),
    ("reward.model_micro_batch_size=0", r"^reward\.model_micro_batch_size=0 must be >= 1$"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RlhfConfig, "configs/tiny_cpu.yaml", [override])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"^config file 'nope\.yaml' does not exist"):
        load_config(RlhfConfig, "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("mesh: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(RlhfConfig, bad)


def test_parse_override_values():
    assert parse_override("a.b=1e-6") == (["a", "b"], "1e-6")  # YAML 1.1; float fields accept it
    assert load_config(RlhfConfig, None, ["comm.min_bucket_mb=5e-1"]).comm.min_bucket_mb == 0.5
    assert parse_override("a=[0, 4]") == (["a"], [0, 4])
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a=hello") == (["a"], "hello")

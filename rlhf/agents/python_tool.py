"""Python execution for tool-calling agents: each call runs the code in a fresh subprocess with CPU-time,
address-space and file-size limits, a wall-clock timeout (the whole process group is killed), an empty
environment and a scratch folder of its own as working and home directory (removed afterwards).

This is a resource-limited subprocess, NOT a security sandbox: the code runs as this user and can read what the
user can read and write anywhere the user can by absolute path. It keeps honest mistakes (endless loops, memory
blow-ups, relative-path writes) from hurting the run; use a container or a remote sandbox for untrusted models.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rlhf.agents.tools import ToolError, ToolTimeout
from rlhf.errors import ConfigError

# Runs first in the child: the limits are set by the child on itself (no preexec_fn: unsafe beside threads).
_BOOTSTRAP = """\
import resource, sys
cpu_s, memory_bytes, file_bytes = (int(v) for v in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
source = open("main.py").read()
del resource, cpu_s, memory_bytes, file_bytes
sys.argv = ["main.py"]
exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
"""


class PythonTool:
    """`python(code)`: runs `code`, returns its stdout and stderr (truncated) and a non-zero exit status."""

    schema = {"type": "function", "function": {
        "name": "python", "description": "Run a Python program and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}

    def __init__(self, *, cpu_time_s: int = 5, memory_mb: int = 512, file_size_mb: int = 16,
                 wall_time_s: float = 10.0, max_output_chars: int = 2000, scratch_root: str | None = None) -> None:
        for name, value in (("cpu_time_s", cpu_time_s), ("memory_mb", memory_mb), ("file_size_mb", file_size_mb),
                            ("wall_time_s", wall_time_s), ("max_output_chars", max_output_chars)):
            if value <= 0:
                raise ConfigError(f"python tool {name}={value} must be positive")
        self.cpu_time_s, self.memory_mb, self.file_size_mb = cpu_time_s, memory_mb, file_size_mb
        self.wall_time_s, self.max_output_chars, self.scratch_root = wall_time_s, max_output_chars, scratch_root

    def call(self, arguments: dict[str, Any], **sample_kwargs: Any) -> str:
        if self.scratch_root is not None:
            Path(self.scratch_root).mkdir(parents=True, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix="python-tool-", dir=self.scratch_root)
        try:
            Path(scratch, "main.py").write_text(arguments["code"])
            return self._run(scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _run(self, scratch: str) -> str:
        limits = [str(self.cpu_time_s), str(self.memory_mb << 20), str(self.file_size_mb << 20)]
        env = {"PATH": os.defpath, "HOME": scratch, "TMPDIR": scratch, "PYTHONDONTWRITEBYTECODE": "1"}
        process = subprocess.Popen([sys.executable, "-I", "-c", _BOOTSTRAP, *limits], cwd=scratch, env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            output, _ = process.communicate(timeout=self.wall_time_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended in between
                pass
            process.communicate()
            raise ToolTimeout(f"python: no result within {self.wall_time_s:g} s (wall clock)") from None
        text = output.decode("utf-8", errors="replace")
        if len(text) > self.max_output_chars:
            text = text[:self.max_output_chars] + f"\n[output truncated at {self.max_output_chars} characters]"
        if process.returncode == -signal.SIGXCPU or process.returncode == -signal.SIGKILL:
            raise ToolError(f"python: stopped at the CPU-time limit ({self.cpu_time_s} s)\n{text}")
        if process.returncode:
            return f"{text}\n[exit status {process.returncode}]"
        return text

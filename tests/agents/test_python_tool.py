"""The Python tool: output, limits, timeout, scratch folder."""

import os

import pytest

from rlhf.agents.python_tool import PythonTool
from rlhf.agents.tools import ToolError, ToolTimeout


def test_runs_code_in_an_empty_environment_and_its_own_scratch(tmp_path):
    tool = PythonTool(scratch_root=str(tmp_path / "scratch"))
    code = ("import os\nopen('note.txt', 'w').write('x')\nprint(sorted(set(os.environ) - {'LC_CTYPE'}))\n"
            "print(os.getcwd() == os.environ['HOME'], sorted(os.listdir('.')))")
    out = tool.call({"code": code})  # (LC_CTYPE: Python's own C-locale coercion, PEP 538)
    assert out == "['HOME', 'PATH', 'PYTHONDONTWRITEBYTECODE', 'TMPDIR']\nTrue ['main.py', 'note.txt']\n"
    assert os.listdir(tmp_path / "scratch") == []  # the call's folder is gone
    assert not (tmp_path / "note.txt").exists()


def test_errors_and_exit_status():
    out = PythonTool().call({"code": "raise SystemExit(3)"})
    assert out.endswith("[exit status 3]")
    assert "ZeroDivisionError" in PythonTool().call({"code": "1/0"})


def test_output_truncated():
    out = PythonTool(max_output_chars=10).call({"code": "print('a' * 100)"})
    assert out == "a" * 10 + "\n[output truncated at 10 characters]"


def test_wall_clock_timeout_kills_the_process_group():
    with pytest.raises(ToolTimeout, match=r"^python: no result within 0.5 s \(wall clock\)$"):
        PythonTool(wall_time_s=0.5).call({"code": "import time\nwhile True: time.sleep(1)"})


def test_cpu_time_limit():
    with pytest.raises(ToolError, match=r"^python: stopped at the CPU-time limit \(1 s\)"):
        PythonTool(cpu_time_s=1, wall_time_s=60).call({"code": "while True: pass"})


def test_memory_and_file_limits():
    assert "MemoryError" in PythonTool(memory_mb=200).call({"code": "x = bytearray(400 << 20)"})
    out = PythonTool(file_size_mb=1).call({"code": "open('big', 'wb').write(b'0' * (2 << 20))"})
    assert "File too large" in out

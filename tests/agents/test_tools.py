"""Tool declarations, argument checks and the calculator."""

import pytest

from rlhf.agents.tools import Calculator, ToolError, load_toolbox
from rlhf.errors import ConfigError


@pytest.mark.parametrize("expression, value", [("12*30", "360"), ("7/2", "3.5"), ("-(3+4)**2", "-49"),
                                               ("17//5 + 17%5", "5"), ("1e3", "1000")])
def test_calculator(expression, value):
    assert Calculator().call({"expression": expression}) == value


@pytest.mark.parametrize("expression, error", [
    ("__import__('os')", "calculator: only numbers and + - * / // % ** ( ) are allowed, got Call"),
    ("1/0", "calculator: ZeroDivisionError: division by zero"),
    ("2**1000", "calculator: exponent 1000 beyond 64"),
    ("1+", "calculator: SyntaxError"),
])
def test_calculator_refuses(expression, error):
    with pytest.raises(ToolError, match="^" + error.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")
                       .replace("+", r"\+")):
        Calculator().call({"expression": expression})


def _write(tmp_path, text):
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    return path


def test_builtin_toolbox_checks_arguments(tmp_path):
    box = load_toolbox(_write(tmp_path, "tools:\n  - class_name: calculator\n  - class_name: python\n"))
    assert sorted(box.tools) == ["calculator", "python"]
    assert [s["function"]["name"] for s in box.schemas] == ["calculator", "python"]
    assert box.call("calculator", {"expression": "2+2"}, {}) == "4"
    with pytest.raises(ToolError, match=r"^calculator: missing required argument\(s\) \['expression'\]$"):
        box.call("calculator", {}, {})
    with pytest.raises(ToolError, match="^calculator: argument 'expression' must be string, got int$"):
        box.call("calculator", {"expression": 4}, {})
    with pytest.raises(ToolError, match=r"^unknown tool 'search'; available: \['calculator', 'python'\]$"):
        box.call("search", {}, {})


@pytest.mark.parametrize("text, error", [
    ("tools: []\n", "needs a non-empty `tools:` list"),
    ("tools:\n  - class_name: nosuch\n", "entry 0: unknown tool class 'nosuch'"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: function}\n", "entry 0: tool_schema must be"),
    ("tools:\n  - class_name: calculator\n  - class_name: calculator\n",
     "entry 1: a second tool named 'calculator'"),
    ("tools:\n  - class_name: calculator\n    config: {nope: 1}\n", "entry 0: calculator(nope): "),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: c, parameters: "
     "{type: object, properties: {x: {type: complex}}}}}\n", "parameter 'x' has type 'complex'; use one of"),
])
def test_tool_config_errors_name_file_and_entry(tmp_path, text, error):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=f"^tool config {path}") as info:
        load_toolbox(path)
    assert error in str(info.value) and "\n" not in str(info.value)


def test_missing_tool_config(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_toolbox(tmp_path / "absent.yaml")

"""Tools as verl declares them: an OpenAI function schema each, listed in a YAML tool config, with per-sample
keyword arguments from the dataset's `extra_info.tools_kwargs[<tool name>]`.

    tools:
      - class_name: calculator              # a built-in name, or "package.module.ClassName"
        config: {}                          # the class's constructor keywords
        tool_schema: {type: function, function: {name: calculator, description: ..., parameters: {...}}}

A tool's `call(arguments, **sample_kwargs) -> str` returns the text the model reads back; it raises `ToolError`
for a failure the model should see, `ToolTimeout` when it ran out of time. Arguments are checked against the
schema's `parameters` (required keys, JSON types) before the call.
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from rlhf.errors import ConfigError

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list}


class ToolError(Exception):
    """A tool call failed in a way the model is told about (bad arguments, an exception inside the tool)."""


class ToolTimeout(ToolError):
    """A tool call outlived its wall-clock limit."""


class Tool(Protocol):
    schema: dict[str, Any]

    def call(self, arguments: dict[str, Any], **sample_kwargs: Any) -> str: ...


@dataclass(frozen=True)
class ToolSpec:
    """A checked OpenAI function schema."""

    name: str
    parameters: dict[str, Any]
    schema: dict[str, Any]

    @classmethod
    def parse(cls, schema: Any, where: str) -> "ToolSpec":
        function = schema.get("function") if isinstance(schema, dict) else None
        if not isinstance(function, dict) or schema.get("type") != "function" or not isinstance(
                function.get("name"), str):
            raise ConfigError(f"{where}: tool_schema must be {{type: function, function: {{name: str, "
                              f"description: str, parameters: object}}}}, got {schema!r:.120}")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ConfigError(f"{where}: tool {function['name']!r} parameters must be a JSON-schema object")
        for key, prop in parameters.get("properties", {}).items():
            if not isinstance(prop, dict) or prop.get("type", "string") not in _JSON_TYPES:
                raise ConfigError(f"{where}: tool {function['name']!r} parameter {key!r} has type "
                                  f"{prop.get('type') if isinstance(prop, dict) else prop!r}; use one of "
                                  f"{sorted(_JSON_TYPES)}")
        return cls(function["name"], parameters, schema)

    def check_arguments(self, arguments: dict[str, Any]) -> None:
        """Raise ToolError naming what does not fit the schema (what the model reads back)."""
        properties = self.parameters.get("properties", {})
        missing = [key for key in self.parameters.get("required", []) if key not in arguments]
        if missing:
            raise ToolError(f"{self.name}: missing required argument(s) {missing}")
        unknown = sorted(set(arguments) - set(properties))
        if unknown and self.parameters.get("additionalProperties", True) is False:
            raise ToolError(f"{self.name}: unknown argument(s) {unknown}; expected {sorted(properties)}")
        for key, value in arguments.items():
            expected = _JSON_TYPES[properties.get(key, {}).get("type", "string")] if key in properties else object
            if not isinstance(value, expected) or (isinstance(value, bool) and expected in (int, (int, float))):
                raise ToolError(f"{self.name}: argument {key!r} must be {properties[key].get('type')}, got "
                                f"{type(value).__name__}")


class Calculator:
    """Arithmetic on numbers with + - * / // % ** and parentheses (no names, no calls; bounded powers)."""

    schema = {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression and return its value.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}
    _BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
    _UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}

    def __init__(self, max_exponent: int = 64, max_length: int = 200) -> None:
        self.max_exponent, self.max_length = max_exponent, max_length

    def call(self, arguments: dict[str, Any], **sample_kwargs: Any) -> str:
        expression = arguments["expression"]
        if len(expression) > self.max_length:
            raise ToolError(f"calculator: expression longer than {self.max_length} characters")
        try:
            value = self._eval(ast.parse(expression, mode="eval").body)
        except (SyntaxError, ZeroDivisionError, OverflowError, RecursionError) as error:
            raise ToolError(f"calculator: {type(error).__name__}: {error}") from None
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        return str(value)

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in self._UNARY:
            return self._UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in self._BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise ToolError(f"calculator: exponent {right} beyond {self.max_exponent}")
            return self._BINARY[type(node.op)](left, right)
        raise ToolError(f"calculator: only numbers and + - * / // % ** ( ) are allowed, got "
                        f"{type(node).__name__}")


BUILTIN = {"calculator": "rlhf.agents.tools.Calculator", "python": "rlhf.agents.python_tool.PythonTool"}


@dataclass(frozen=True)
class ToolBox:
    """The tools of a run by name, with their checked schemas."""

    tools: dict[str, Tool]
    specs: dict[str, ToolSpec]

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """What the chat template lists (`apply_chat_template(tools=...)`)."""
        return [spec.schema for spec in self.specs.values()]

    def call(self, name: str, arguments: dict[str, Any], sample_kwargs: dict[str, Any]) -> str:
        """Check and run one call; raises ToolError (the model reads it) for an unknown tool or bad arguments."""
        if name not in self.tools:
            raise ToolError(f"unknown tool {name!r}; available: {sorted(self.tools)}")
        self.specs[name].check_arguments(arguments)
        return self.tools[name].call(arguments, **sample_kwargs.get(name, {}))


def load_toolbox(path: str | Path) -> ToolBox:
    """Read a verl-style tool config; every problem is a ConfigError naming the file and the entry."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"tool config {path} does not exist; point multiturn.tool_config at a YAML file with a "
                          "`tools:` list")
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"tool config {path}: not valid YAML ({error})") from None
    entries = document.get("tools") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"tool config {path}: needs a non-empty `tools:` list")
    tools, specs = {}, {}
    for index, entry in enumerate(entries):
        where = f"tool config {path} entry {index}"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ConfigError(f"{where}: needs `class_name` (a built-in: {sorted(BUILTIN)}, or module.Class)")
        tool = _instantiate(entry["class_name"], entry.get("config") or {}, where)
        spec = ToolSpec.parse(entry.get("tool_schema") or getattr(tool, "schema", None), where)
        if spec.name in tools:
            raise ConfigError(f"{where}: a second tool named {spec.name!r}; tool names must be unique")
        tools[spec.name], specs[spec.name] = tool, spec
    return ToolBox(tools, specs)


def _instantiate(class_name: str, config: Any, where: str) -> Tool:
    target = BUILTIN.get(class_name, class_name)
    module_name, _, attribute = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(f"{where}: unknown tool class {class_name!r}; use a built-in ({sorted(BUILTIN)}) or an "
                          "importable module.Class") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: `config` must be a mapping of constructor arguments, got {config!r:.80}")
    try:
        return cls(**config)
    except TypeError as error:
        raise ConfigError(f"{where}: {class_name}({', '.join(config)}): {error}") from None

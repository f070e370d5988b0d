"""The config reference (docs/config.md), generated from the dataclasses: key, type, default, allowed values, meaning.

A key's meaning is the comment on its field (trailing, or the comment lines just above it); a section's is its
class docstring. Allowed values come from `Literal` and enum annotations, and from the module-level name a
`__post_init__` checks the field against (`if self.dtype not in DTYPES`), so nothing is stated twice.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import io
import json
import sys
import textwrap
import tokenize
import types
import typing
from functools import cache
from typing import Any, NamedTuple

from rlhf.config.loader import to_dict

HEADER = """# Config reference

Generated from the config dataclasses by `rlhf config --reference docs/config.md` (a test fails when this page
is stale); do not edit by hand. Every key can be set in the YAML file (`section:` then `key: value`) or on the command line
as a dotted override (`actor.optim.lr=1e-6`); `rlhf config --print --config FILE [overrides...]` prints the
resolved tree. Unknown keys are errors with a did-you-mean hint.
"""


class Key(NamedTuple):
    """One row of the reference: a leaf key of the config tree."""

    path: str
    type: str
    default: str
    choices: str
    meaning: str


class Section(NamedTuple):
    path: str
    doc: str
    keys: list[Key]


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return "str" if all(isinstance(a, str) for a in args) else "literal"
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args if a is not Ellipsis)}]"
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "str"
    return getattr(tp, "__name__", str(tp))


def _literal_choices(tp: Any) -> list[str]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return [str(a) for a in args]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return [str(member.value) for member in tp]
    if origin in (typing.Union, types.UnionType):
        choices = [c for a in args for c in _literal_choices(a)]
        return (["true", "false"] if choices and bool in args else []) + choices
    return []


def _yaml_value(value: Any) -> str:
    value = to_dict(value)
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`"


def _comments(source: str) -> dict[int, str]:
    """Line number (1-based, within `source`) -> the text of the comment on that line."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0]: tok.string.lstrip("#").strip() for tok in tokens if tok.type == tokenize.COMMENT}


@cache
def _class_info(cls: type) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(field -> comment, field -> allowed values checked in __post_init__) read from the class source."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = _comments(source)
    node = ast.parse(source).body[0]
    meanings: dict[str, str] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            text = comments.get(stmt.end_lineno, "")
            above = stmt.lineno - 1
            block = []
            while above >= 1 and lines[above - 1].strip().startswith("#"):
                block.insert(0, comments[above])
                above -= 1
            meanings[stmt.target.id] = " ".join(block + [text]).strip()
    return meanings, _checked_choices(node, sys.modules[cls.__module__].__dict__)


def _checked_choices(node: ast.ClassDef, module_globals: dict) -> dict[str, list[str]]:
    """`self.x not in NAME` (or `for v in self.x: ... v not in NAME`) in __post_init__ -> {x: NAME's values}."""
    post_init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__post_init__"), None)
    found: dict[str, list[str]] = {}
    if post_init is None:
        return found
    loop_vars = {stmt.target.id: stmt.iter.attr for stmt in ast.walk(post_init)
                 if isinstance(stmt, ast.For) and isinstance(stmt.target, ast.Name)
                 and isinstance(stmt.iter, ast.Attribute)}
    for compare in ast.walk(post_init):
        if not (isinstance(compare, ast.Compare) and isinstance(compare.ops[0], ast.NotIn)):
            continue
        left, right = compare.left, compare.comparators[0]
        if isinstance(left, ast.Call) and isinstance(left.func, ast.Attribute):  # self.x.upper()
            left = left.func.value
        if isinstance(left, ast.Attribute) and isinstance(left.value, ast.Name) and left.value.id == "self":
            name = left.attr
        elif isinstance(left, ast.Name) and left.id in loop_vars:
            name = loop_vars[left.id]
        else:
            continue
        if isinstance(right, ast.Name) and right.id in module_globals:
            found[name] = [str(v) for v in module_globals[right.id]]
        elif isinstance(right, ast.Tuple) and all(isinstance(e, ast.Constant) for e in right.elts):
            found[name] = [str(e.value) for e in right.elts]
    return found


def _section_type(tp: Any) -> type | None:
    """The dataclass a field holds (also `X | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    arms = [a for a in typing.get_args(tp) if a is not type(None)]
    return arms[0] if len(arms) == 1 and dataclasses.is_dataclass(arms[0]) else None


def _default(field: dataclasses.Field, instance: Any) -> str:
    """A field's declared default (`auto` stays `auto`, though the root config resolves it), else the instance's."""
    if field.default is not dataclasses.MISSING:
        return _yaml_value(field.default)
    if instance is not None:
        return _yaml_value(getattr(instance, field.name))
    if field.default_factory is not dataclasses.MISSING:
        return _yaml_value(field.default_factory())
    return "required"


def sections(cls: type, path: str = "", instance: Any = None) -> list[Section]:
    """Every section of the tree under `cls` (depth first), with its leaf keys."""
    hints = typing.get_type_hints(cls)
    meanings, checked = _class_info(cls)
    doc = " ".join(inspect.cleandoc(cls.__doc__ or "").split())
    own = Section(path, doc, [])
    nested: list[Section] = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        key = f"{path}.{field.name}" if path else field.name
        tp = hints[field.name]
        sub = _section_type(tp)
        if sub is not None:
            value = getattr(instance, field.name) if instance is not None else None
            nested.extend(sections(sub, key, value if dataclasses.is_dataclass(value) else None))
            if type(None) in typing.get_args(tp):
                own.keys.append(Key(key, f"{sub.__name__} | null", "null", "",
                                    meanings.get(field.name, "") or f"the `{key}` section below, or null"))
            continue
        choices = _literal_choices(tp) or checked.get(field.name, [])
        own.keys.append(Key(key, _type_name(tp), _default(field, instance), ", ".join(f"`{c}`" for c in choices),
                            meanings.get(field.name, "")))
    return ([own] if own.keys else []) + nested


def render(cls: type) -> str:
    """The reference page for the config tree rooted at `cls` (an instance gives the defaults)."""
    out = [HEADER]
    for section in sections(cls, instance=cls()):
        out.append(f"\n## `{section.path}`\n")
        if section.doc:
            out.append(f"{section.doc}\n")
        out.append("| key | type | default | allowed | meaning |\n|---|---|---|---|---|")
        for key in section.keys:
            cells = [f"`{key.path}`", key.type, key.default, key.choices, key.meaning]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"

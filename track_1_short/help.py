"""``python -m track_1_short.train --help``: the groups, the presets and every config field, from the schema.

Hydra's own help prints the composed YAML, which says what the values are but not what they mean. The meaning
lives in the schema: each field of a group's dataclass carries a docstring (the string literal after it, the
attribute-docstring convention), read here with :mod:`ast`. Each field is listed with the value the default
run (no overrides) gives it and the first sentence of its docstring; the groups and presets are the YAML files
under ``configs/``, each with its first comment line.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from functools import cache
from pathlib import Path

WIDTH = 110


@cache
def attribute_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring} of a dataclass, from the string literal that follows each field."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, following in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(following.value.value)
    return docs


def first_sentence(doc: str) -> str:
    """The docstring's first sentence, on one line."""
    text = " ".join(doc.split())
    cut = text.find(". ")
    while cut != -1 and text[max(0, cut - 3) : cut + 1] in ("e.g.", "i.e."):  # not a sentence's end
        cut = text.find(". ", cut + 1)
    return text if cut == -1 else text[: cut + 1]


def _short(value, limit: int = 40) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def field_lines(cls: type, values: dict, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, value in the default run, first sentence of the docstring) for every field, nested
    dataclasses expanded."""
    docs = attribute_docs(cls)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        value = values.get(f.name) if isinstance(values, dict) else None
        tp = hints.get(f.name)
        if dataclasses.is_dataclass(tp):
            out += field_lines(tp, value or {}, key + ".")
            continue
        out.append((key, _short(value), first_sentence(docs.get(f.name, ""))))
    return out


def _first_comment(path: Path) -> str:
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("#") and not line.startswith("# @package"):
            return line.lstrip("#").strip()
    return ""


def render(configs: Path) -> str:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from track_1_short.config import TrainConfig

    with initialize_config_dir(str(configs), version_base=None):
        default = OmegaConf.to_container(compose("train"), resolve=True)
    lines = [
        "usage: python -m track_1_short.train [group=option ...] [key=value ...]",
        "       torchrun --standalone --nproc_per_node=N -m track_1_short.train [...]   (N processes)",
        "",
        "With no arguments: the embedded default run (experiment=default: model=tiny, data=synthetic, "
        "schedule=smoke) on the CPU.",
        "resume=<run dir> continues a stopped run with the settings in its config.yaml.",
        "",
        "Groups (group=option; experiment= picks a preset of all of them):",
    ]
    for group in sorted(p for p in configs.iterdir() if p.is_dir()):
        lines.append(f"  {group.name}:")
        for option in sorted(group.glob("*.yaml")):
            text = textwrap.wrap(_first_comment(option), WIDTH - 21) or [""]
            lines.append(f"    {option.stem:<16} {text[0]}")
            lines += [f"{'':21}{more}" for more in text[1:]]
    lines += ["", "Fields (key=value; the value shown is the default run's):"]
    rows = field_lines(TrainConfig, default)
    key_w = min(max(len(k) for k, _, _ in rows), 42)
    for key, value, doc in rows:
        head = f"  {key:<{key_w}} = {value}"
        wrapped = textwrap.wrap(doc, WIDTH - 8) or [""]
        lines.append(head)
        lines += [f"        {w}" for w in wrapped]
    lines += [
        "",
        "More: --cfg job prints the composed config, interpolations resolved (what the run will use);",
        "--hydra-help prints Hydra's own flags. Exit status: 0 finished, 1 failed, 2 bad input, 130 Ctrl-C.",
    ]
    return "\n".join(lines)

"""A msgspec Struct written as TOML that the config loader reads back: sub-Structs become [tables]
(a tagged one with its tag, e.g. `kind`), everything else `key = value`. deploy/ prints resolved configs with it; the learner's periodic eval
hands its config to the eval child with it."""

from __future__ import annotations

import msgspec


def to_toml(obj: msgspec.Struct) -> str:
    return "\n".join(_struct_lines(obj, "")).strip() + "\n"


def _struct_lines(obj: msgspec.Struct, prefix: str) -> list[str]:
    # Sub-Structs become [tables]; everything else (scalars, lists, free maps) is a key = value line.
    lines, subs = [], []
    tag = obj.__struct_config__.tag_field  # a tagged union's member ([weights]) says which it is
    if tag is not None:
        lines.append(f"{tag} = {_toml_value(obj.__struct_config__.tag)}")
    for name in obj.__struct_fields__:
        v = getattr(obj, name)
        if isinstance(v, msgspec.Struct):
            subs.append((name, v))
        else:
            lines.append(f"{name} = {_toml_value(msgspec.to_builtins(v))}")
    out = ([f"[{prefix}]"] if prefix and lines else []) + lines
    for name, v in subs:
        out += [""] + _struct_lines(v, f"{prefix}.{name}" if prefix else name)
    return out


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")

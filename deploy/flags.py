"""Command-line options generated from the typed run config (config/), one source of names,
defaults, bounds and choices: a command names the config keys it exposes, and each option's
type, help text (the field's own comment) and the limits it shows are read from the field.

A value given as an option goes into the config as an override `key=value` that names the option
as its source, so a bad one fails where every config value is checked (config.run.load_config),
with the same one-line error as `--set key=value`: the option itself only parses the text as
the field's Python type. Nothing here is imported by a role; deploy/'s commands use it.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import tokenize
import typing
from dataclasses import dataclass, field
from functools import cache, wraps
from typing import Annotated, Any

import msgspec
import msgspec.inspect as mi
import typer

# the option's Python type for each scalar kind of config field (what typer parses the text as)
_SCALARS: dict[type, type] = {
    mi.IntType: int,
    mi.FloatType: float,
    mi.StrType: str,
    mi.BoolType: bool,
    mi.LiteralType: str,
}
_BOUNDS = ("ge", "gt", "le", "lt")
_BOUND_TEXT = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


@dataclass(frozen=True)
class Flag:
    """One option of a command, backed by config key `key` (section.field, dotted for sub-sections)."""

    key: str
    name: str  # the option, e.g. "--concurrency"
    param: str  # the parameter the command's function sees
    type: type  # what the option's text is parsed as
    default: Any  # the field's default (the Struct's)
    choices: tuple = ()  # a Literal field's values
    bounds: dict[str, float] = field(default_factory=dict)  # Meta's ge / gt / le / lt
    doc: str = ""  # the field's comment or Meta description in config/
    help_text: str = ""  # the command's own words, where the field's comment does not fit it
    envvar: str | None = None

    @property
    def help(self) -> str:
        """The option's help: its words, then the key it overrides and what the type allows."""
        words = self.help_text or (self.doc[:1].upper() + self.doc[1:] if self.doc else "")
        limits = [self.type.__name__]
        limits += [f"{_BOUND_TEXT[b]} {v}" for b, v in self.bounds.items()]
        if self.choices:
            limits = [" | ".join(map(str, self.choices))]
        default = "" if self.default in ("", None) else f", default {self.default}"
        facts = f"[{self.key}: {' '.join(limits)}{default}]"
        return f"{words.rstrip('.')}. {facts}" if words else facts

    def annotation(self):
        """The Annotated type of the command's parameter: the value, or None when not given (the
        config's value stands)."""
        opts: dict[str, Any] = {"help": self.help, "show_default": False}
        if self.envvar:
            opts["envvar"] = self.envvar
        decls = [self.name]
        if self.type is bool:  # a switch both ways: --live / --no-live
            decls = [f"{self.name}/--no-{self.name.removeprefix('--')}"]
        return Annotated[self.type | None, typer.Option(*decls, **opts)]

    def override(self, value: Any) -> tuple[str, str]:
        """The config override for `value` given as this option, and the source its errors name."""
        shown = str(value).lower() if isinstance(value, bool) else value
        return f"{self.key}={json.dumps(value)}", f"{self.name} {shown}"


def flag(key: str, name: str | None = None, *, param: str | None = None, help: str = "", envvar=None) -> Flag:
    """The option for config key `key`; its name defaults to the field's (`--max-actors` for
    up.max_actors). `help` replaces the field's comment where the command means something narrower."""
    owner, info = _field(key)
    leaf = info.name
    # the leaf's own annotation alone (a whole section's type_info would walk every nested Struct)
    ftype = mi.type_info(info.type)
    ftype = ftype.type if isinstance(ftype, mi.Metadata) else ftype
    if type(ftype) not in _SCALARS:
        raise TypeError(f"{key}: a {type(ftype).__name__} field has no option; use --set {key}=...")
    default = info.default if info.default is not msgspec.NODEFAULT else info.default_factory()
    return Flag(
        key=key,
        name=name or "--" + leaf.replace("_", "-"),
        param=param or (name or leaf).removeprefix("--").replace("-", "_"),
        type=_SCALARS[type(ftype)],
        default=default,
        choices=tuple(ftype.values) if isinstance(ftype, mi.LiteralType) else (),
        bounds={b: getattr(ftype, b) for b in _BOUNDS if getattr(ftype, b, None) is not None},
        doc=field_doc(owner, leaf),
        help_text=help,
        envvar=envvar,
    )


def _field(key: str) -> tuple[type, msgspec.structs.FieldInfo]:
    """The Struct class that holds key's last part, walked down from RunConfig, and that field."""
    from parley.config.run import RunConfig

    cls, info = RunConfig, None
    for part in key.split("."):
        if info is not None:
            cls = info.type
        info = next((f for f in msgspec.structs.fields(cls) if f.name == part), None)
        if info is None:
            raise KeyError(f"{key}: {cls.__name__} has no field {part!r}")
    return cls, info


@cache
def _module_comments(module: str) -> dict[str, dict[str, str]]:
    """Each class of `module` -> each field written in its body -> its comment: the comment on the
    field's lines, else the comment lines right above it. One read and parse per module."""
    import sys

    try:
        source = inspect.getsource(sys.modules[module])
    except (OSError, TypeError, KeyError):
        return {}
    lines = source.splitlines()
    by_line = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    out: dict[str, dict[str, str]] = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        fields = out.setdefault(cls.name, {})
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            inline = [by_line[n] for n in range(node.lineno, node.end_lineno + 1) if n in by_line]
            above, n = [], node.lineno - 1
            while n in by_line and lines[n - 1].lstrip().startswith("#"):
                above.insert(0, by_line[n])
                n -= 1
            fields[node.target.id] = " ".join(inline or above)
    return out


def field_doc(cls: type, name: str) -> str:
    """The comment the config gives field `name` of Struct `cls` (inherited fields: where written),
    with its Meta description when it has one."""
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            doc = _module_comments(klass.__module__).get(klass.__qualname__, {}).get(name, "")
            break
    else:
        doc = ""
    hint = typing.get_type_hints(cls, include_extras=True).get(name)
    described = [m.description for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)]
    extra = next((d for d in described if d and d not in doc), "")
    return f"{doc} ({extra})" if doc and extra else doc or extra


def with_flags(*flags: Flag):
    """A command that also takes `flags` as options: their given values reach the function as
    `flagged`, a list of config overrides (override, source) for deploy.common.resolve's `extra`.
    A flag whose parameter the function declares itself (unannotated, default None) is also passed
    as its value, for a command that reads the option beside the config (`up --resume` and --env)."""

    def wrap(fn):
        sig = inspect.signature(fn, eval_str=True)
        by_param = {f.param: f for f in flags}
        own = [p for p in sig.parameters.values() if p.name != "flagged"]
        declared = {p.name for p in own} & set(by_param)
        for name in declared:
            if sig.parameters[name].annotation is not inspect.Parameter.empty:
                raise TypeError(f"{fn.__name__}: {name} is option {by_param[name].name}; leave it unannotated")
        kw = inspect.Parameter.KEYWORD_ONLY
        params = [
            p.replace(kind=kw, annotation=by_param[p.name].annotation(), default=None)
            if p.name in declared
            else p.replace(kind=kw)
            for p in own
        ]
        params += [
            inspect.Parameter(f.param, kw, default=None, annotation=f.annotation())
            for f in flags
            if f.param not in declared
        ]

        @wraps(fn)
        def command(**kwargs):
            given = [f.override(kwargs[f.param]) for f in flags if kwargs[f.param] is not None]
            for f in flags:
                if f.param not in declared:
                    del kwargs[f.param]
            return fn(**kwargs, flagged=given)

        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.flags = flags
        return command

    return wrap

"""The run configuration: one TOML file with a section per role, decoded into typed Structs.

Every `parley` command calls `load_config(path, overrides)`; each role's entry takes the RunConfig
and reads its own sections and the shared ones ([run], [env], [nats], [bus], [policy]). Unknown
keys are rejected with their path, bad values fail here (before any work) with one line naming the
key, the value, what is allowed and the fix. Overrides are dotted `section.key=value` strings (values parsed as TOML, else text).
"""

from __future__ import annotations

import difflib
import re
import tomllib
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect as mi

from parley.config.actor import ActorConfig, SimConfig
from parley.config.env import EnvConfig
from parley.config.learner import DataConfig, LearnerConfig, RolloutConfig
from parley.config.policy import PolicySection
from parley.config.scorer import JudgeConfig, ScorerConfig
from parley.environments.base import Environment, ProgrammaticUser
from parley.errors import ConfigError
from parley.protocol.messages import GREEDY_BELOW
from parley.protocol.settings import RUN_NAME, BusSettings
from parley.runtime.toml import to_toml
from parley.weights.config import ObjstoreWeights, WeightsConfig, check_kind, from_gpu_buffer


class RunSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[run]: identity and where files go."""

    # run name: prefixes every subject, stream and bucket
    name: Annotated[str, msgspec.Meta(pattern=RUN_NAME.pattern, description="use 1-64 of A-Z a-z 0-9 _ -")] = "local"
    dir: str = ""  # run directory; "" = runs/<name>
    # a named preset (deploy/configs/recipes/<name>.toml, e.g. "verl-collabllm") laid over the embedded
    # default and under the file that names it: the file's keys and --set win (docs/recipe.md); "" = none
    recipe: str = ""


class NatsSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[nats]: how roles reach the bus."""

    url: str = "nats://127.0.0.1:4222"  # comma-separated for a cluster
    connect_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0  # first connect only; later drops reconnect forever
    creds: str = ""  # .creds file (else PARLEY_NATS_CREDS)
    ca_file: str = ""  # TLS CA (else PARLEY_NATS_CA)


class UpSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[up]: the local supervisor."""

    actors: Annotated[int, msgspec.Meta(ge=1)] = 1
    # `--actors auto`: start min_actors, then add and remove actors on the TASKS consumer's waiting
    # messages, one actor per tasks_per_actor of them, within [min_actors, max_actors] (deploy/autoscale.py)
    autoscale: bool = False
    min_actors: Annotated[int, msgspec.Meta(ge=1)] = 1
    max_actors: Annotated[int, msgspec.Meta(ge=1)] = 4
    tasks_per_actor: Annotated[int, msgspec.Meta(ge=0, description="0 = actor.concurrency // rollout.n")] = 0
    scale_down_after_s: Annotated[float, msgspec.Meta(ge=0.0)] = 60.0  # the backlog stays low this long first
    scorers: Annotated[int, msgspec.Meta(ge=1)] = 1
    # a failed actor, scorer or services child is started again (the same command, its log continued,
    # after 1, 2, 4 ... s) at most `restarts` times in any `restart_window_s`; the bus gives its unsettled
    # messages to another worker. A failed learner is started again with --resume once it has written its
    # ledger (RUN_DIR/learner/state.msgpack). Exit code 2 (a config error, which the same command meets
    # again), a failure before the child said ready, a learner with no ledger yet or one restart too
    # many stops the run (runtime/supervisor.py, deploy/up.py). `parley eval --services fleet` starts its
    # actors and scorers again under the same two settings. 0 = never.
    restarts: Annotated[int, msgspec.Meta(ge=0)] = 3
    restart_window_s: Annotated[float, msgspec.Meta(gt=0.0)] = 600.0
    live: bool = True  # live terminal view (off when stdout is not a terminal)
    # every child serves Prometheus metrics on a free port of 127.0.0.1, printed and written to
    # RUN_DIR/prometheus-targets.json (a file_sd_configs file)
    metrics: bool = True
    # the GPU's memory for the memory plan of a run on a GPU (deploy/memory.py); 0 = ask torch.cuda
    gpu_memory_gib: Annotated[float, msgspec.Meta(ge=0.0, description="0 = detect")] = 0.0
    # how the processes on one GPU share its compute: "plain", the GPU time-slices their kernels; "mps",
    # `parley up` starts a CUDA MPS daemon for the run and every child's kernels go through its server
    # (deploy/mps.py; needs nvidia-cuda-mps-control, checked before anything starts); "auto", phased
    # where it is allowed and only its memory plan fits or earlier runs of this workload on this GPU
    # measured it faster, else MPS where the daemon can serve, plain otherwise (deploy/gpu_share.py; said at start);
    # "phased", the learner and the actor take the GPU in turns: the actor's engine sleeps (frees its
    # KV cache and weights, [actor] sleep_level) while the learner steps and wakes for the next version
    # (actors/phases.py; needs learner.max_staleness = 0 and one actor: config.run.check_phased)
    gpu_share: Literal["auto", "plain", "mps", "phased"] = "auto"

    def __post_init__(self) -> None:
        if self.min_actors > self.max_actors:
            raise ValueError(
                f"up.min_actors={self.min_actors} > up.max_actors={self.max_actors}; "
                "the autoscaler's lower bound must not pass its upper one"
            )

    def first_actors(self) -> int:
        """Actors `parley up` starts with."""
        return self.min_actors if self.autoscale else self.actors

    def most_actors(self) -> int:
        """Actors that may run at once (what the memory plan and the CPU split count)."""
        return self.max_actors if self.autoscale else self.actors


class LogSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[log]: where a run's numbers go besides metrics.jsonl and TensorBoard (always written)."""

    # Weights & Biases: the learner's step metrics and eval means, and `parley up`'s eval table and report
    # charts; online when WANDB_API_KEY is set, else an offline run dir under RUN_DIR/wandb (`wandb sync`)
    wandb: bool = False
    wandb_project: str = "parley"
    wandb_entity: str = ""  # "" = the key's default entity


class RunConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    run: RunSection = msgspec.field(default_factory=RunSection)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    policy: PolicySection = msgspec.field(default_factory=PolicySection)
    # how versions reach the actors, read by the learner and the actors alike:
    # [weights] kind = objstore | shared_dir | cuda_ipc | nccl (weights/config.py)
    weights: WeightsConfig = msgspec.field(default_factory=ObjstoreWeights)
    nats: NatsSection = msgspec.field(default_factory=NatsSection)
    bus: BusSettings = msgspec.field(default_factory=BusSettings)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    actor: ActorConfig = msgspec.field(default_factory=ActorConfig)
    sim: SimConfig = msgspec.field(default_factory=SimConfig)
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    scorer: ScorerConfig = msgspec.field(default_factory=ScorerConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    up: UpSection = msgspec.field(default_factory=UpSection)
    log: LogSection = msgspec.field(default_factory=LogSection)

    def __post_init__(self) -> None:
        try:
            resolve_environment(self)
        except LookupError as e:  # an unknown or doubly registered name: a config error like any other
            raise ValueError(str(e)) from None
        if self.policy.reference == "service" and self.learner.kl_coef <= 0:
            raise ValueError(
                f"policy.reference='service' with learner.kl_coef={self.learner.kl_coef}: without a KL term no "
                'reference is used; set learner.kl_coef > 0 or policy.reference = "local"'
            )
        check_prefix_cache(self)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.name}")


def check_prefix_cache(cfg: RunConfig) -> None:
    """[*.engine] prefix_cache_across_versions where it can mean something: the actor's engine, whose
    whole weights are swapped in place. A service's engine never changes weights, and under LoRA adapter
    versions no conversation changes weights mid-way (each stays on the adapter it started on, and vLLM
    hashes the adapter into every cached block): the setting would change nothing there."""
    for section in ("sim", "judge"):
        if getattr(cfg, section).engine.prefix_cache_across_versions:
            raise ValueError(
                f"{section}.engine.prefix_cache_across_versions = true: the {section} engine never swaps its "
                f"weights, so there is no cache to keep across versions; set it to false (it is an "
                "[actor.engine] setting)"
            )
    if cfg.actor.engine.prefix_cache_across_versions and cfg.learner.lora.adapter_versions:
        raise ValueError(
            'actor.engine.prefix_cache_across_versions = true with [learner.lora] serve = "adapter": '
            "adapter versions keep the prefix cache already (a conversation stays on the adapter it "
            "started on; a new adapter is a new cache key in vLLM); set it to false, or "
            'learner.lora.serve = "merged" (whole weights swapped in place)'
        )


def resolve_environment(cfg: RunConfig) -> Environment:
    """Check the sections that name the environment's parts against it, and fill in what they leave
    to it (each "" or {} below), so every role reads concrete values. Run once per decode: a dumped
    config decodes to the same values.

    - [scorer] weights {} = the environment's default weights; weights and clamps name its metrics.
    - [scorer] keys the environment names as its scorer_options (CollabLLM's bleu_variant, extract,
      interactivity) become its options (the one place a run sets them); another environment's
      reward does not read them (so one file can serve either with --env).
    - [rollout] sim_prompt "" = the environment's simulator prompt; a programmatic user takes none.
    - [learner] eval_metric "" = the environment's `eval.select`; else one of its `eval.selectable`.
    """
    sc = cfg.scorer
    cfg.env.options = cfg.env.scored_as(sc).options
    env = cfg.env.load()
    names = env.reward.names
    for what, keys in (("weights", sc.weights), ("clamps", sc.clamps)):
        unknown = [k for k in keys if k not in names]
        if unknown:
            raise ValueError(
                f"scorer.{what}: unknown reward metric {', '.join(map(repr, unknown))} for environment "
                f"{env.name!r}; its metrics are {list(names)}"
            )
    if not sc.weights:
        sc.weights = env.reward.default_weights()
    ro = cfg.rollout
    if isinstance(env.user, ProgrammaticUser):
        if ro.sim_prompt:
            raise ValueError(
                f"rollout.sim_prompt={ro.sim_prompt!r}: environment {env.name!r} plays a programmatic "
                "user (no simulator), so it takes no simulator prompt; leave rollout.sim_prompt empty"
            )
    elif not ro.sim_prompt:
        ro.sim_prompt = env.user.prompt
    lc = cfg.learner
    if not lc.eval_metric:
        lc.eval_metric = env.eval.select
    elif lc.eval_metric not in env.eval.selectable:
        raise ValueError(
            f"learner.eval_metric={lc.eval_metric!r} is not a selectable metric of environment "
            f'{env.name!r}; use one of {list(env.eval.selectable)} (or "" for {env.eval.select!r})'
        )
    return env


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # bare words are strings: actor.engine.model=smol


# Where each key's value came from (dotted key -> "path/to/file.toml", "--set k=v", "PARLEY_RUN"):
# an error names the source of the bad value, not the file it happens to be laid over.
Origin = dict[str, str]


def apply_override(data: dict, override: str, origin: Origin | None = None, source: str = "") -> None:
    source = source or f"--set {override}"
    if "=" not in override:
        raise ConfigError(f"{source}: {override!r} must look like section.key=value")
    key, _, text = override.partition("=")
    new = key.strip()
    parts = new.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{source}: {p!r} is not a section")
    node[parts[-1]] = _parse_value(text.strip())
    if origin is not None:
        for k in [k for k in origin if k == new or k.startswith(new + ".")]:
            del origin[k]
        origin[new] = source


def default_config_path() -> Path:
    return Path(str(resources.files("parley.deploy") / "configs" / "default.toml"))


def read_toml(path: Path) -> dict:
    """A config file as a dict; a missing file, a directory or bad TOML is a one-line ConfigError."""
    if path.is_dir():
        files = sorted(p.name for p in path.glob("*.toml"))[:4]
        raise ConfigError(
            f"--config {path} is a directory; give a TOML file"
            + (f", e.g. {path / files[0]} (it holds {', '.join(files)})" if files else "")
        )
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not a text (UTF-8) file; give a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def _is_section(key: str) -> bool:
    """Whether dotted `key` names a section (a Struct, merged key by key) rather than a value that
    happens to be a table ([scorer] weights, [env] options, template_kwargs: replaced whole)."""
    typ: Any = _run_type()
    for part in key.split("."):
        typ, _ = _unwrap(typ, "")
        if isinstance(typ, mi.UnionType):  # a tagged union such as [weights]: its kinds share the keys
            typ = next((t for t in typ.types if isinstance(t, mi.StructType)), None)
        if not isinstance(typ, mi.StructType):
            return False
        typ = next((f.type for f in typ.fields if f.encode_name == part), None)
    typ, _ = _unwrap(typ, "")
    return isinstance(typ, mi.StructType) or (
        isinstance(typ, mi.UnionType) and any(isinstance(t, mi.StructType) for t in typ.types)
    )


def _lay_over(base: dict, top: dict, origin: Origin, source: str, prefix: str = "") -> None:
    """Lay `top` over `base` key by key (sections merge, values replace), noting each key's source."""
    for k, v in top.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and _is_section(key):  # key by key, so each key's source is known
            if not isinstance(base.get(k), dict):
                base[k] = {}
                origin.pop(key, None)
            _lay_over(base[k], v, origin, source, key + ".")
            continue
        base[k] = v
        for old in [o for o in origin if o.startswith(key + ".")]:
            del origin[old]
        origin[key] = source


Override = str | tuple[str, str]  # "section.key=value", or with the source to name in errors


def load_config(path: str | Path | None = None, overrides: list[Override] | None = None) -> RunConfig:
    """Read the embedded default, lay `path` over it (a file says only what differs from the
    default: one source of defaults), apply overrides, validate.

    The embedded default (deploy/configs/default.toml) is the one set of defaults a file is read
    against; the Structs' own defaults only serve sections built in code (tests, benchmarks)."""
    default = default_config_path()
    path = Path(path) if path else default
    data: dict = {}
    origin: Origin = {}
    top = read_toml(path)
    # a recipe ([run] recipe, named by the file or an override) goes over the embedded default and
    # under the file: the file's own keys and the overrides win (docs/recipe.md)
    name = recipe_named(top, overrides or [])
    recipe = [(recipe_data(name, str(path)), f"recipe {name}")] if name else []
    if path.resolve() != default.resolve():
        layers = [(read_toml(default), str(default)), *recipe, (top, str(path))]
    else:
        layers = [(top, str(path)), *recipe]
    for layer, source in layers:
        _lay_over(data, layer, origin, source)
    for o in overrides or []:
        text, source = o if isinstance(o, tuple) else (o, "")
        apply_override(data, text, origin, source)
    return convert_config(data, source=str(path), origin=origin)


def recipes_dir() -> Path:
    return Path(str(resources.files("parley.deploy") / "configs" / "recipes"))


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.toml"))


def recipe_data(name: str, source: str = "<config>") -> dict:
    """The settings recipe `name` fixes, as a TOML document (deploy/configs/recipes/NAME.toml)."""
    if name not in recipe_names():
        raise ConfigError(
            f'{source}: run.recipe = {name!r}: no such recipe; use one of {recipe_names()} (or "" for none)'
        )
    return tomllib.loads((recipes_dir() / f"{name}.toml").read_text())


def recipe_named(top: dict, overrides: list[Override]) -> str:
    """The recipe a config file (`top`) and its overrides name; the last override naming one wins."""
    named: dict = {"run": {"recipe": top.get("run", {}).get("recipe", "")}}
    for o in overrides:
        text = o[0] if isinstance(o, tuple) else o
        if text.partition("=")[0].strip() == "run.recipe":
            apply_override(named, text)
    return named["run"]["recipe"]


def convert_config(data: dict, source: str = "<config>", origin: Origin | None = None) -> RunConfig:
    try:
        check_kind(data)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    try:
        return msgspec.convert(data, RunConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(explain(e, data, source, origin or {})) from None


def source_of(key: str, origin: Origin, fallback: str) -> str:
    """Who set `key` (dotted): the source of the key itself or of the nearest section above it; for a
    section, the sources of what was set in it (the embedded default's last)."""
    parts = key.split(".") if key else []
    for n in range(len(parts), 0, -1):
        if (k := ".".join(parts[:n])) in origin:
            return origin[k]
    below = sorted({v for k, v in origin.items() if not key or k.startswith(key + ".")})
    default = str(default_config_path())
    named = [s for s in below if s != default] or below
    return " / ".join(named) or fallback


_STEP = re.compile(r"\.(\w+)|\[(\d+)\]|\[\.\.\.\]")
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


@cache
def _run_type() -> mi.Type:
    return mi.type_info(RunConfig)


def explain(e: msgspec.ValidationError, data: dict, source: str, origin: Origin | None = None) -> str:
    """msgspec's message ("Expected `int` >= 2 - at `$.rollout.n`") as one line that also gives the
    value's source, the whole allowed range and the field's hint: "--set rollout.n=1: rollout.n = 1:
    expected an int >= 2 and <= 1024 (GRPO needs a group)". An unknown key gets the closest known
    one. Errors raised by a section's own checks pass unchanged, after their source."""
    origin = origin or {}
    text, sep, at = str(e).rpartition(" - at `")
    if not sep:  # at the top level msgspec names no path
        text, at = str(e), "$"
        if not text.startswith("Object contains unknown field"):
            return f"{source_of('', origin, source)}: {e}"
    steps = [
        m.group(1) if m.group(1) is not None else (int(m.group(2)) if m.group(2) else None)
        for m in _STEP.finditer(at.rstrip("`"))
    ]
    key = ".".join(str(s) if isinstance(s, str) else f"[{'...' if s is None else s}]" for s in steps)
    key = key.replace(".[", "[")
    typ, hint = _run_type(), ""
    for s in steps:
        typ, hint = _unwrap(typ, hint)
        if isinstance(typ, mi.StructType) and isinstance(s, str):
            typ = next((f.type for f in typ.fields if f.encode_name == s), None)
        elif isinstance(typ, mi.DictType):
            typ = typ.value_type
        elif isinstance(typ, (mi.ListType, mi.TupleType)):
            typ = typ.item_type if isinstance(typ, mi.ListType) else None
        else:
            typ = None
        hint = ""
    typ, hint = _unwrap(typ, hint)
    if text.startswith("Object contains unknown field"):
        field = text.split("`")[1]
        full = f"{key}.{field}" if key else field
        where = source_of(full, origin, source)
        node = data
        for s in steps:
            node = node.get(s) if isinstance(node, dict) else None
        kinds = _union_kinds(typ)
        if kinds and isinstance(node, dict) and node.get(kinds[0]) in kinds[1]:
            tag_field, by_tag = kinds
            typ = by_tag[node[tag_field]]
            elsewhere = sorted(t for t, st in by_tag.items() if field in _field_names(st))
            if elsewhere:
                return (
                    f"{where}: {full}: unknown key for {tag_field} = {node[tag_field]!r}; it is a key of "
                    f"{tag_field} = {' or '.join(map(repr, elsewhere))}"
                )
        known = _field_names(typ)
        close = difflib.get_close_matches(field, known, n=1, cutoff=0.6)
        if close and not key:
            return f"{where}: [{field}]: unknown section; did you mean {close[0]!r}?"
        if close:
            return f"{where}: {full}: unknown key; did you mean {key + '.' + close[0]!r}?"
        cap = 20 if not key else 12  # every section; a section's first keys
        listed = ", ".join(known[:cap]) + (f", ... ({len(known)} in all)" if len(known) > cap else "")
        if not key:
            return f"{where}: [{field}]: unknown section; the sections are {listed}"
        return f"{where}: {full}: unknown key; [{key}] has {listed}"
    where = source_of(key, origin, source)
    if text.startswith("Object missing required field"):
        return f"{where}: [{key}] needs the key {text.split('`')[1]!r}"
    if not (text.startswith("Expected") or text.startswith("Invalid enum value")):
        return f"{where}: {text}"  # a section's __post_init__ said what is wrong, and how to fix it
    value, found = data, True
    for s in steps:
        try:
            value = value[s]
        except (KeyError, IndexError, TypeError):
            found = False
            break
    allowed = _allowed(typ)
    head = f"{where}: {key} = {value!r}" if found else f"{where}: {key}"
    got = text.split(", got ", 1)[1] if ", got " in text else ""
    what = f"expected {allowed}" if allowed else text[0].lower() + text[1:]
    if got and allowed:
        what += f", got {got}"
    return f"{head}: {what}" + (f" ({hint})" if hint else "")


def _union_kinds(typ: Any) -> tuple[str, dict[str, Any]] | None:
    """A tagged union's tag field and its Structs by tag value, or None."""
    if not isinstance(typ, mi.UnionType):
        return None
    structs = [t for t in typ.types if isinstance(t, mi.StructType) and t.tag_field]
    if not structs:
        return None
    return structs[0].tag_field, {t.tag: t for t in structs}


def _field_names(typ: Any) -> list[str]:
    """The keys a section takes (for a tagged union such as [weights], those of all its kinds)."""
    if isinstance(typ, mi.StructType):
        return [f.encode_name for f in typ.fields]
    if isinstance(typ, mi.UnionType):
        names = {f.encode_name for t in typ.types if isinstance(t, mi.StructType) for f in t.fields}
        tags = {t.tag_field for t in typ.types if isinstance(t, mi.StructType) and t.tag_field}
        return sorted(names | tags)
    return []


def _unwrap(typ: Any, hint: str) -> tuple[Any, str]:
    if isinstance(typ, mi.Metadata):
        return typ.type, (typ.extra_json_schema or {}).get("description", hint)
    return typ, hint


def _allowed(typ: Any) -> str:
    """What a value of `typ` may be, in words; "" when it says no more than its type."""
    if isinstance(typ, mi.LiteralType):
        return "one of " + ", ".join(map(repr, typ.values))
    if isinstance(typ, (mi.IntType, mi.FloatType)):
        name = "an int" if isinstance(typ, mi.IntType) else "a float"
        bounds = [f"{op} {getattr(typ, k)}" for k, op in _BOUNDS if getattr(typ, k) is not None]
        return " ".join([name, " and ".join(bounds)]) if bounds else f"`{'int' if name == 'an int' else 'float'}`"
    if isinstance(typ, mi.StrType) and typ.pattern:
        return f"a str matching {typ.pattern!r}"
    if isinstance(typ, mi.StrType) and typ.min_length:
        return "a non-empty str" if typ.min_length == 1 else f"a str of at least {typ.min_length} characters"
    return ""


def check_training(cfg: RunConfig) -> None:
    """Cross-section checks of a run that trains (`parley learner`, `parley up`), made at their start.

    The actors record the log-prob of each sampled token under the distribution it was drawn from,
    softmax(logits / temperature), and the learner recomputes that distribution from the trajectory's
    temperature (engines/engine.py's docstring). It does not recompute a top-p cut, and a temperature
    of 0 (greedy) has no distribution: the PPO ratio and the importance weights would be taken against
    the wrong behaviour policy, silently. The reference service answers raw log-probs, which a KL to
    a policy sampled at another temperature would mix with tempered ones. Not checked when the file
    is loaded: an eval (whose actors sample at the eval's temperature, evaluation/fleet.py) trains
    nothing and may sample as it likes.
    """
    check_phased(cfg)
    lr = cfg.learner.lora
    if lr.merged and cfg.actor.engine.max_lora_rank > 0:
        # the versions are whole weights: vLLM's LoRA slots would cost GPU memory and decode time
        # (its LoRA kernels run on every projection) and never be used
        raise ConfigError(
            f'[learner.lora] serve = "merged" with actor.engine.max_lora_rank={cfg.actor.engine.max_lora_rank}: '
            "the actors get whole weights with the adapter merged in and need no LoRA; set "
            'actor.engine.max_lora_rank = 0, or learner.lora.serve = "adapter"'
        )
    if lr.adapter_versions and cfg.actor.engine.max_lora_rank < lr.rank:
        raise ConfigError(
            f"[learner.lora] rank={lr.rank} but actor.engine.max_lora_rank="
            f"{cfg.actor.engine.max_lora_rank}: the actors could not load the adapters; set "
            f"actor.engine.max_lora_rank = {lr.rank}"
        )
    if lr.adapter_versions:  # merged versions are whole weights: every transport and delta format carries them
        from parley.weights import registry

        transport = registry.of(cfg.weights)
        if not transport.carries_adapters:
            raise ConfigError(
                f"[learner.lora] with [weights] kind={transport.kind!r}: an adapter travels as files "
                "(objstore, shared_dir) or in a shared GPU buffer on the learner's GPUs (cuda_ipc); "
                'set weights.kind = "objstore", "shared_dir" or "cuda_ipc"'
            )
        if getattr(cfg.weights, "delta_format", "file") == "packed":
            raise ConfigError(
                '[learner.lora] with [weights] delta_format = "packed": an adapter version is the '
                "adapter alone (megabytes), never a delta of the whole model; set "
                'weights.delta_format = "file" (the default)'
            )
    a = cfg.actor.sampling
    if not (GREEDY_BELOW <= a.temperature < float("inf")):
        raise ConfigError(
            f"actor.sampling.temperature={a.temperature}: training needs a temperature >= {GREEDY_BELOW:g} (below it "
            "vLLM samples greedily and no sampled token has a tempered log-prob to train); set "
            "actor.sampling.temperature to 1.0 (the default) or e.g. 0.7"
        )
    if a.top_p != 1.0:
        raise ConfigError(
            f"actor.sampling.top_p={a.top_p}: training needs top_p = 1.0 (the learner recomputes softmax(logits / "
            "temperature), not a top-p cut, so the PPO ratio would be wrong); set actor.sampling.top_p=1.0 and lower "
            "actor.sampling.temperature instead (an eval, which trains nothing, may sample with top-p)"
        )
    if a.temperature != 1.0 and cfg.learner.kl_coef > 0 and cfg.policy.reference == "service":
        raise ConfigError(
            f"actor.sampling.temperature={a.temperature} with policy.reference='service': the reference service "
            "answers log-probs of the raw model, the policy's are at the actor's temperature; set "
            "policy.reference='local' (the learner's own reference is taken at each sample's temperature), "
            "learner.kl_coef=0 or actor.sampling.temperature=1.0"
        )


def check_phased(cfg: RunConfig) -> None:
    """`[up] gpu_share = "phased"` (actors/phases.py), refused where phased_refusal names a reason."""
    if cfg.up.gpu_share == "phased" and (why := phased_refusal(cfg)) is not None:
        raise ConfigError(why)


def phased_refusal(cfg: RunConfig) -> str | None:
    """Why `[up] gpu_share = "phased"` cannot run this config (one line with the value and the fix),
    or None; asked whatever gpu_share says, so "auto" (deploy/gpu_share.py) never picks it where it
    would be refused. The actor's engine sleeps once the groups of the step being trained are played
    and wakes when the learner announces the next version. That leaves the actor nothing to decode
    while the learner steps only when the staleness gate admits no group on a version before the next
    one is announced (max_staleness = 0, no oversampled groups), and only when one actor plays every
    group of a step (its count of them is what tells it to sleep). Level 2 discards the engine's
    weights, which LoRA adapters served on the base need kept, and which a version that came in the
    learner's GPU buffer cannot refill once that buffer holds the next version."""
    lc, fix = cfg.learner, 'or [up] gpu_share = "mps"'
    if lc.max_staleness != 0:
        return (
            f'[up] gpu_share = "phased" with learner.max_staleness={lc.max_staleness}: the actor sleeps while the '
            f"learner steps, so no group may be played on the version being trained; set learner.max_staleness = 0 {fix}"
        )
    if lc.oversample_groups:
        return (
            f'[up] gpu_share = "phased" with learner.oversample_groups={lc.oversample_groups}: extra groups would '
            f"be played while the learner steps; set learner.oversample_groups = 0 {fix}"
        )
    if cfg.up.most_actors() > 1:
        return (
            f'[up] gpu_share = "phased" with {cfg.up.most_actors()} actors: one actor takes turns with the learner '
            f"(it counts a step's groups to know when to sleep); set up.actors = 1 and up.autoscale = false {fix}"
        )
    if cfg.actor.sleep_level == 2 and cfg.actor.engine.max_lora_rank > 0:
        return (
            f"actor.sleep_level = 2 with actor.engine.max_lora_rank={cfg.actor.engine.max_lora_rank}: level 2 "
            "discards the engine's weights, and LoRA adapter versions are served on the base, which is never "
            "loaded again; set actor.sleep_level = 1 (or 0: chosen by what is served)"
        )
    if cfg.actor.sleep_level == 2 and from_gpu_buffer(cfg.weights):
        kind = type(cfg.weights).__struct_config__.tag
        return (
            f'actor.sleep_level = 2 with weights.kind = "{kind}": level 2 discards the engine\'s weights, and a '
            "version that came in the learner's GPU buffer cannot be loaded again once the next version is packed "
            "into it (a group issued again while asleep, or a wake whose new version fails to load, would stop "
            "the actor); set actor.sleep_level = 1 (or 0: chosen by what is served)"
        )
    return None


def dump_config(cfg: RunConfig) -> str:
    """The resolved configuration as TOML (what --dry-run prints and `up` writes per role)."""
    return to_toml(cfg)

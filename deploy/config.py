"""The run configuration: one TOML file with a section per role, decoded into typed Structs.

Every role command calls `load_config(path, overrides)`. Unknown keys are rejected with their
path, bad values fail here (before any work) with a one-line error naming the field and fix.
Overrides are dotted `section.key=value` strings (values parsed as TOML, else taken as text).
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path

import msgspec

from actors.config import ActorConfig, SimConfig
from environments.base import Environment, ProgrammaticUser
from environments.config import EnvConfig
from learner.config import DataConfig, LearnerConfig, RolloutConfig
from protocol.topology import RUN_NAME, BusSettings
from runtime.toml import to_toml
from scorer.config import JudgeConfig, ScorerConfig


class RunSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[run]: identity and where files go."""

    name: str = "local"  # run name: prefixes every subject, stream and bucket
    dir: str = ""  # run directory; "" = runs/<name>

    def __post_init__(self) -> None:
        if not RUN_NAME.match(self.name):
            raise ValueError(f"name={self.name!r} not allowed; use 1-64 of A-Z a-z 0-9 _ -")


class NatsSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[nats]: how roles reach the bus."""

    url: str = "nats://127.0.0.1:4222"  # comma-separated for a cluster
    connect_timeout_s: float = 10.0  # first connect only; later drops reconnect forever
    creds: str = ""  # .creds file (else PARLEY_NATS_CREDS)
    ca_file: str = ""  # TLS CA (else PARLEY_NATS_CA)


class UpSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[up]: the local supervisor."""

    actors: int = 1
    scorers: int = 1
    live: bool = True  # live terminal view (off when stdout is not a terminal)


class RunConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    run: RunSection = msgspec.field(default_factory=RunSection)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
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

    def __post_init__(self) -> None:
        try:
            resolve_environment(self)
        except LookupError as e:  # an unknown or doubly registered name: a config error like any other
            raise ValueError(str(e)) from None

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.name}")


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
            raise ValueError(f"scorer.{what}: unknown reward metric {', '.join(map(repr, unknown))} for environment "
                             f"{env.name!r}; its metrics are {list(names)}")
    if not sc.weights:
        sc.weights = env.reward.default_weights()
    ro = cfg.rollout
    if isinstance(env.user, ProgrammaticUser):
        if ro.sim_prompt:
            raise ValueError(f"rollout.sim_prompt={ro.sim_prompt!r}: environment {env.name!r} plays a programmatic "
                             "user (no simulator), so it takes no simulator prompt; leave rollout.sim_prompt empty")
    elif not ro.sim_prompt:
        ro.sim_prompt = env.user.prompt
    lc = cfg.learner
    if not lc.eval_metric:
        lc.eval_metric = env.eval.select
    elif lc.eval_metric not in env.eval.selectable:
        raise ValueError(f"learner.eval_metric={lc.eval_metric!r} is not a selectable metric of environment "
                         f"{env.name!r}; use one of {list(env.eval.selectable)} (or \"\" for {env.eval.select!r})")
    return env


class ConfigError(ValueError):
    """A bad config file or override; the message is one line naming the field."""


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # bare words are strings: actor.engine.model=smol


def apply_override(data: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    key, _, text = override.partition("=")
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {p!r} is not a section")
    node[parts[-1]] = _parse_value(text.strip())


def default_config_path() -> Path:
    return Path(str(resources.files("deploy") / "configs" / "default.toml"))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read `path` (default: the embedded default), apply overrides, validate."""
    path = Path(path) if path else default_config_path()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    for o in overrides or []:
        apply_override(data, o)
    return convert_config(data, source=str(path))


def convert_config(data: dict, source: str = "<config>") -> RunConfig:
    try:
        return msgspec.convert(data, RunConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None


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
    a = cfg.actor
    if not (0.0 < a.temperature < float("inf")):
        raise ConfigError(
            f"actor.temperature={a.temperature}: training needs a temperature > 0 (at 0 the policy is greedy and "
            "no sampled token has a log-prob to train); set actor.temperature to 1.0 (the default) or e.g. 0.7"
        )
    if a.top_p != 1.0:
        raise ConfigError(
            f"actor.top_p={a.top_p}: training needs top_p = 1.0 (the learner recomputes softmax(logits / "
            "temperature), not a top-p cut, so the PPO ratio would be wrong); set actor.top_p=1.0 and lower "
            "actor.temperature instead (an eval, which trains nothing, may sample with top-p)"
        )
    if a.temperature != 1.0 and cfg.learner.kl_coef > 0 and cfg.learner.reference == "service":
        raise ConfigError(
            f"actor.temperature={a.temperature} with learner.reference='service': the reference service answers "
            "log-probs of the raw model, the policy's are at the actor's temperature; set learner.reference='local' "
            "(the learner's own reference is taken at each sample's temperature), kl_coef=0 or temperature=1.0"
        )


def dump_config(cfg: RunConfig) -> str:
    """The resolved configuration as TOML (what --dry-run prints and `up` writes per role)."""
    return to_toml(cfg)

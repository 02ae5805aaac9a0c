"""The layout is the architecture: roles meet only on the bus. Reads every module's imports with
`ast` (top level and inside functions) and fails, naming the file and the import, when
- a role package imports another role package,
- a role or a neutral package imports deploy/ (the launcher sits on top; nothing calls up into it),
- protocol/ imports anything of ours but itself,
- a neutral package imports a role (evaluation/ and rollout/ included: the conversation loop and
  the scoring of one trajectory live in rollout/, so the learner's periodic eval reaches no role),
- protocol/ imports torch, vllm or deepspeed (the wire contract loads without them),
- a transport name ("objstore", "shared_dir", "cuda_ipc", "nccl") is compared as a string outside
  weights/ (callers ask the transport: weights.registry),
- a neutral package imports one on its own floor or above it (FLOORS, docs/architecture.md): the
  neutral packages form no cycle, so each can be read, tested and moved with what is below it,
- a package of ours is imported by its bare folder name (`import config`) instead of under the one
  import name, `parley.config` (the folders sit at the root; installed they live under parley/),
- a package imports from parley/ anything but parley.errors (the Python API sits on top, the error
  tree below everything, protocol/ included), or parley/errors.py imports anything of ours,
- a module names its logger with a literal "parley..." string instead of `getLogger(__name__)` (the
  name then follows the module; another library's logger, e.g. "huggingface_hub", is named as it is).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("actors", "scorer", "learner")
NEUTRAL = (
    "config",
    "engines",
    "weights",
    "tasks",
    "rewards",
    "runtime",
    "services",
    "rollout",
    "evaluation",
    "environments",
)
OURS = (*ROLES, *NEUTRAL, "protocol", "deploy")
HEAVY = ("torch", "vllm", "deepspeed")  # none of these under protocol/
TRANSPORT_NAMES = {"objstore", "shared_dir", "cuda_ipc", "nccl"}  # compared only inside weights/
# The neutral packages from the ground up (protocol/ below them all, the roles and deploy/ above):
# a neutral package imports only packages on lower floors. docs/architecture.md draws the same floors.
FLOORS = (
    ("runtime",),  # process, metrics, durable files: weights/ writes its versions through runtime.durable
    ("tasks", "rewards", "weights"),
    ("engines", "environments"),
    ("config",),
    ("services",),
    ("rollout",),
    ("evaluation",),
)
FLOOR = {name: level for level, names in enumerate(FLOORS) for name in names}
assert set(FLOOR) == set(NEUTRAL), "every neutral package has a floor"


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in the file, relative imports resolved (under parley.)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = "parley." + ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
    return out


def transport_compares(path: Path) -> list[tuple[int, list[str]]]:
    """(line, names) for every comparison (==, !=, in, not in, ...) with transport names as string
    constants, alone or inside a tuple, list or set literal."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Compare):
            continue
        names = []
        for operand in [node.left, *node.comparators]:
            consts = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            names += [c.value for c in consts if isinstance(c, ast.Constant) and c.value in TRANSPORT_NAMES]
        if names:
            out.append((node.lineno, names))
    return out


def literal_loggers(path: Path) -> list[tuple[int, str]]:
    """(line, name) for every getLogger call given a literal name of ours ("parley" or below it)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func, arg = node.func, node.args[0]
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if called == "getLogger" and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            if arg.value == "parley" or arg.value.startswith("parley."):
                out.append((node.lineno, arg.value))
    return out


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for top in OURS:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            if top != "weights":
                bad += [
                    f"{rel}:{line}: compares with the transport name {', '.join(map(repr, names))} "
                    "(outside weights/, ask the transport: weights.registry)"
                    for line, names in transport_compares(path)
                ]
            bad += [
                f"{rel}:{line}: logger named {name!r}; name it logging.getLogger(__name__)"
                for line, name in literal_loggers(path)
            ]
            for line, mod in imports_of(path, root):
                if mod.split(".")[0] in OURS:
                    bad.append(f"{rel}:{line}: import of {mod} by its bare name (import parley.{mod})")
                    continue
                if (mod == "parley" or mod.startswith("parley.")) and mod.split(".")[1:2] != ["errors"]:
                    if mod == "parley" or mod.split(".")[1] not in OURS:
                        bad.append(
                            f"{rel}:{line}: import of {mod} (of parley/ only parley.errors is below the packages)"
                        )
                        continue
                mod = mod.removeprefix("parley.")
                head = mod.split(".")[0]
                if top == "protocol" and head in HEAVY:
                    bad.append(f"{rel}:{line}: import of {mod} (protocol/ imports no {head})")
                if head not in OURS or head == top:
                    continue
                where = f"{rel}:{line}: import of {mod}"
                if top == "protocol":
                    bad.append(f"{where} (protocol/ imports nothing of ours)")
                elif head == "deploy":
                    bad.append(f"{where} ({top}/ must not import the launcher deploy/)")
                elif top in ROLES and head in ROLES:
                    bad.append(f"{where} (role {top}/ imports role {head}/: roles meet only on the bus)")
                elif top in NEUTRAL and head in ROLES:
                    bad.append(f"{where} (neutral {top}/ imports role {head}/)")
                elif top in NEUTRAL and head in NEUTRAL and FLOOR[head] >= FLOOR[top]:
                    bad.append(f"{where} (neutral {top}/ imports {head}/, which is not below it: see FLOORS)")
    tree = root / "parley" / "errors.py"
    if tree.is_file():
        bad += [
            f"parley/errors.py:{line}: import of {mod} (the error tree imports nothing of ours)"
            for line, mod in imports_of(tree, root)
            if mod.split(".")[0] in (*OURS, "parley")
        ]
    return bad


def test_no_forbidden_imports():
    bad = violations()
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "top, line, expect",
    [
        ("learner", "from parley.actors.actor import Actor", "role learner/ imports role actors/"),
        ("scorer", "from parley.deploy.common import resolve", "must not import the launcher deploy/"),
        ("protocol", "from parley.engines.engine import PolicyEngine", "protocol/ imports nothing of ours"),
        ("tasks", "import parley.scorer.scorer", "neutral tasks/ imports role scorer/"),
        ("evaluation", "from parley.actors.actor import Actor", "neutral evaluation/ imports role actors/"),
        (
            "evaluation",
            "def f():\n    from parley.scorer.scorer import Scorer",
            "neutral evaluation/ imports role scorer/",
        ),
        ("evaluation", "import parley.learner.checkpoint", "neutral evaluation/ imports role learner/"),
        ("rollout", "from parley.actors.actor import Actor", "neutral rollout/ imports role actors/"),
        ("services", "from parley.scorer.scorer import Scorer", "neutral services/ imports role scorer/"),
        ("services", "from parley.deploy.up import up", "services/ must not import the launcher deploy/"),
        (
            "services",
            "from parley.rollout.conversation import run_conversation",
            "neutral services/ imports rollout/, which is not below it",
        ),
        ("rollout", "from parley.scorer.config import ScorerConfig", "neutral rollout/ imports role scorer/"),
        ("rollout", "from parley.deploy.config import RunConfig", "rollout/ must not import the launcher deploy/"),
        ("actors", "def f():\n    from parley.learner import grpo", "role actors/ imports role learner/"),
        ("protocol", "def f():\n    import torch", "protocol/ imports no torch"),
        ("protocol", "from vllm import LLM", "protocol/ imports no vllm"),
        ("protocol", "import deepspeed.zero", "protocol/ imports no deepspeed"),
        ("learner", "if cfg.kind == 'cuda_ipc':\n    pass", "compares with the transport name 'cuda_ipc'"),
        ("actors", 'ok = wv.transport != "objstore"', "compares with the transport name 'objstore'"),
        ("engines", 'gpu = kind in ("cuda_ipc", "nccl")', "compares with the transport name 'cuda_ipc'"),
        ("deploy", "x = 'shared_dir' not in kinds", "compares with the transport name 'shared_dir'"),
        (
            "config",
            "from parley.evaluation.selection import REWARD_REFUSED",
            "neutral config/ imports evaluation/, which is not below it",
        ),
        (
            "engines",
            "from parley.config.run import RunConfig",
            "neutral engines/ imports config/, which is not below it",
        ),
        ("tasks", "from parley.rewards.reward import mr", "neutral tasks/ imports rewards/, which is not below it"),
        ("learner", "from config.run import RunConfig", "import of config.run by its bare name"),
        ("deploy", "def f():\n    import weights.registry", "import of weights.registry by its bare name"),
        ("learner", "from parley import up", "of parley/ only parley.errors is below the packages"),
        ("scorer", "import parley", "of parley/ only parley.errors is below the packages"),
        ("weights", 'log = logging.getLogger("parley.weights")', "name it logging.getLogger(__name__)"),
        ("deploy", "def f():\n    getLogger('parley').info('x')", "logger named 'parley'"),
    ],
)
def test_a_forbidden_import_is_named(tmp_path, top, line, expect):
    """Each rule fails on a planted import, naming the file and the import."""
    for t in OURS:
        (tmp_path / t).mkdir()
    (tmp_path / top / "planted.py").write_text(line + "\n")
    bad = violations(tmp_path)
    assert len(bad) == 1 and expect in bad[0] and f"{top}/planted.py" in bad[0], bad


def test_allowed_imports_pass(tmp_path):
    for t in OURS:
        (tmp_path / t).mkdir()
    (tmp_path / "learner" / "ok.py").write_text(
        "from parley.protocol import bus\nfrom parley.tasks.data import Item\nfrom parley.rewards import diagnostics\n"
    )
    (tmp_path / "evaluation" / "ok.py").write_text(
        "from parley.rollout.conversation import run_conversation\nfrom parley.rollout.score import score_trajectory\n"
    )
    (tmp_path / "rollout" / "ok.py").write_text(
        "from parley.environments.base import Reward\nfrom parley.protocol.bus import Retry\n"
    )
    (tmp_path / "actors" / "ok.py").write_text("from parley.rollout.conversation import run_conversation\n")
    # a service is below the conversation loop and the roles, above config/ and engines/
    (tmp_path / "rollout" / "ok2.py").write_text("from parley.services.sim.client import SimClient\n")
    (tmp_path / "services" / "ok.py").write_text(
        "from parley.config.scorer import JudgeConfig\nfrom parley.engines.service import Service\n"
    )
    (tmp_path / "scorer" / "ok.py").write_text("from parley.rollout.score import score_trajectory\n")
    (tmp_path / "deploy" / "ok.py").write_text(
        "from parley.learner.service import run\nfrom parley.actors.actor import run\n"
    )
    # inside weights/ a transport may name itself; elsewhere naming one without comparing is fine
    (tmp_path / "weights" / "ok.py").write_text("import torch\nGPU = kind in ('cuda_ipc', 'nccl')\n")
    (tmp_path / "learner" / "ok2.py").write_text("DEFAULT = 'objstore'\nlog.info('%s', 'nccl')\n")
    (tmp_path / "tasks" / "ok.py").write_text(
        "log = logging.getLogger(__name__)\nhub = logging.getLogger('huggingface_hub')\nw = getLogger('vllm.parley')\n"
    )
    # the error tree is below everything, protocol/ included
    (tmp_path / "protocol" / "ok.py").write_text("from parley.errors import ProtocolError\n")
    (tmp_path / "parley").mkdir()
    (tmp_path / "parley" / "errors.py").write_text("from __future__ import annotations\n")
    assert violations(tmp_path) == []


def _module_file(mod: str, root: Path) -> Path | None:
    base = root.joinpath(*mod.removeprefix("parley.").split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def reach(start: Path, root: Path = ROOT) -> dict[str, str]:
    """Every module of ours that `start` imports, directly or through other modules of ours (inside
    functions included), each with the module that imported it first."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        path = todo.pop()
        here = "parley." + ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(), filename=str(path))
        found = [mod for _, mod in imports_of(path, root)]
        # `from pkg import mod` names a module too
        found += [
            f"{n.module}.{a.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and not n.level
            for a in n.names
        ]
        for mod in found:
            if mod.startswith("parley.") and mod not in seen and (f := _module_file(mod, root)):
                seen[mod] = here
                todo.append(f)
    return seen


@pytest.mark.parametrize("start", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "learner").rglob("*.py")))
def test_the_learner_reaches_no_other_role(start):
    """The learner's imports, followed through evaluation/ (the periodic eval, the leakage guard)
    and every neutral package, never arrive at actors/ or scorer/."""
    bad = {m: by for m, by in reach(ROOT / start).items() if m.split(".")[1] in ROLES and m.split(".")[1] != "learner"}
    assert not bad, f"{start} reaches " + ", ".join(f"{m} (imported by {by})" for m, by in sorted(bad.items()))


def test_the_error_tree_imports_nothing_of_ours(tmp_path):
    for t in OURS:
        (tmp_path / t).mkdir()
    (tmp_path / "parley").mkdir()
    (tmp_path / "parley" / "errors.py").write_text("from parley.protocol import codec\n")
    bad = violations(tmp_path)
    assert len(bad) == 1 and "parley/errors.py:1" in bad[0] and "imports nothing of ours" in bad[0], bad


def test_reach_follows_imports_through_neutral_packages(tmp_path):
    """The walk above can fail: a learner module that reaches a role through evaluation/ is found."""
    for t in OURS:
        (tmp_path / t).mkdir()
    (tmp_path / "learner" / "a.py").write_text("def f():\n    from parley.evaluation import periodic\n")
    (tmp_path / "evaluation" / "periodic.py").write_text("from parley.scorer.scorer import Scorer\n")
    (tmp_path / "scorer" / "scorer.py").write_text("")
    assert reach(tmp_path / "learner" / "a.py", tmp_path) == {
        "parley.evaluation.periodic": "parley.learner.a",
        "parley.scorer.scorer": "parley.evaluation.periodic",
    }


# The learner's two halves (docs/architecture.md): the control half meets the bus and imports no torch;
# the compute half runs the model and imports no NATS (nor the control half, which would bring it
# in); plain modules, the bookkeeping both read, import neither. Every learner module is in one list.
LEARNER_CONTROL = ("feeder", "intake", "lease", "resume", "runstate", "service", "stepper", "watchers")
LEARNER_COMPUTE = ("attention", "checkpoint", "grpo", "logprobs", "lora", "packing", "ranks", "steplog", "trainer")
LEARNER_PLAIN = ("__init__", "envrecord", "flops", "groups")
TORCH = ("torch", "deepspeed", "transformers", "vllm", "peft", "flash_attn")
# the parts of protocol/ that talk to NATS (messages, arrays and codec are plain data)
NATS = (
    "nats",
    "parley.protocol.bus",
    "parley.protocol.connect",
    "parley.protocol.dead",
    "parley.protocol.topology",
    "parley.protocol.request",
    "parley.protocol.backlog",
    "parley.protocol.status",
)


def learner_half_violations(root: Path = ROOT) -> list[str]:
    half_of = {
        **{m: "control" for m in LEARNER_CONTROL},
        **{m: "compute" for m in LEARNER_COMPUTE},
        **{m: "plain" for m in LEARNER_PLAIN},
    }
    bad = []
    for path in sorted((root / "learner").rglob("*.py")):
        rel = path.relative_to(root)
        half = half_of.get(path.relative_to(root / "learner").with_suffix("").as_posix())
        if half is None:
            bad.append(
                f"{rel}: in no half of the learner (name it in LEARNER_CONTROL, LEARNER_COMPUTE or LEARNER_PLAIN)"
            )
            continue
        for line, mod in imports_of(path, root):
            where = f"{rel}:{line}: import of {mod}"
            if mod.split(".")[0] in TORCH and half != "compute":
                bad.append(f"{where} (the learner's {half} half imports no torch)")
            if any(mod == n or mod.startswith(n + ".") for n in NATS) and half != "control":
                bad.append(f"{where} (the learner's {half} half imports no NATS)")
            inner = half_of.get(mod.removeprefix("parley.learner.")) if mod.startswith("parley.learner.") else None
            if half != "control" and inner == "control":
                bad.append(f"{where} (the learner's {half} half imports its control half)")
            if half == "plain" and inner == "compute":
                bad.append(f"{where} (the learner's plain modules import neither half)")
    return bad


def test_the_learners_control_and_compute_halves_stay_apart():
    bad = learner_half_violations()
    assert not bad, "the learner's halves:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "module, line, expect",
    [
        ("feeder", "import torch", "the learner's control half imports no torch"),
        ("stepper", "def f():\n    import torch", "the learner's control half imports no torch"),
        ("trainer", "from parley.protocol.bus import publish", "the learner's compute half imports no NATS"),
        ("packing", "def f():\n    import nats.errors", "the learner's compute half imports no NATS"),
        ("grpo", "from parley.learner.feeder import Feeder", "the learner's compute half imports its control half"),
        ("groups", "import deepspeed", "the learner's plain half imports no torch"),
        ("groups", "from parley.learner.packing import Sample", "the learner's plain modules import neither half"),
        ("newpart", "x = 1", "in no half of the learner"),
    ],
)
def test_a_learner_module_in_the_wrong_half_is_named(tmp_path, module, line, expect):
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / f"{module}.py").write_text(line + "\n")
    bad = learner_half_violations(tmp_path)
    assert len(bad) == 1 and expect in bad[0] and f"learner/{module}.py" in bad[0], bad


def test_the_halves_allow_what_they_are_for(tmp_path):
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "service.py").write_text(
        "from parley.protocol.bus import PullWorker\ndef f():\n    from parley.learner.trainer import Trainer\n"
    )
    (tmp_path / "learner" / "trainer.py").write_text(
        "import torch\nfrom parley.protocol.messages import Scored\nfrom parley.learner.groups import Taken\n"
    )
    assert learner_half_violations(tmp_path) == []

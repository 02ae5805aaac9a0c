"""parley: asynchronous GRPO for multi-turn collaborative assistants over NATS JetStream.

The one import name of the project. Its packages are `parley.protocol`, `parley.actors`,
`parley.scorer`, `parley.learner`, `parley.deploy` and the neutral ones below the roles
(`parley.config`, `parley.weights`, `parley.environments`, ...). The Python API runs what the
command line runs:

    import parley
    cfg = parley.load_config("deploy/configs/tiny.toml", ["learner.steps=2"])
    code = parley.up("deploy/configs/tiny.toml", steps=2, run_dir="runs/try")
    code = parley.eval("deploy/configs/default.toml", "--weights", "v0=runs/try/eval/models/v0")

A third-party environment subclasses `parley.Environment` (docs/environments.md).
Everything heavy (torch, vLLM, DeepSpeed) is imported only when a command runs.
"""

from __future__ import annotations

from pathlib import Path

# In a source checkout the packages sit beside this folder, at the repository's root, where the
# design keeps them; an installed wheel holds them under parley/ (pyproject's package-dir) and this
# adds nothing there. The marker is our own pyproject, so no other folder is ever searched.
_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "protocol" / "__init__.py").is_file() and 'name = "parley-grpo"' in (
    (_ROOT / "pyproject.toml").read_text() if (_ROOT / "pyproject.toml").is_file() else ""
):
    __path__.append(str(_ROOT))  # noqa: F821 (a package's __path__)

__all__ = ["Environment", "RunConfig", "load_config", "up", "eval", "replay", "select", "command"]


def command(*argv: str) -> int:
    """Run one `parley` command line in this process (`command("up", "--steps", "2")`) and return
    its exit code, as the shell would see it."""
    from parley.deploy.cli import run

    return run([str(a) for a in argv])


def _options(config, sets) -> list[str]:
    out = ["--config", str(config)] if config is not None else []
    for s in sets:
        out += ["--set", s]
    return out


def up(
    config: str | Path | None = None,
    *args: str,
    steps: int | None = None,
    sets: tuple[str, ...] = (),
    run_dir: str | Path | None = None,
    env: str | None = None,
) -> int:
    """`parley up`: the whole system on this machine (the embedded default without `config`)."""
    extra = [*_options(config, sets), "--no-live"]
    extra += ["--steps", str(steps)] if steps is not None else []
    extra += ["--run-dir", str(run_dir)] if run_dir is not None else []
    extra += ["--env", env] if env is not None else []
    return command("up", *extra, *args)


def eval(config: str | Path | None = None, *args: str, sets: tuple[str, ...] = ()) -> int:  # noqa: A001
    """`parley eval`: the benchmark over held-out items; `args` are its options (`--weights`, ...)."""
    return command("eval", *_options(config, sets), *args)


def replay(source: str | Path, *args: str) -> int:
    """`parley replay SOURCE`: re-score logged conversations."""
    return command("replay", str(source), *args)


def select(run_dir: str | Path, metric: str = "mr") -> int:
    """`parley select RUN_DIR --metric M`: the best evaluated version by a named eval metric."""
    return command("select", str(run_dir), "--metric", metric)


def __getattr__(name: str):
    # the types load on first use, so `import parley` stays light
    if name in ("RunConfig", "load_config"):
        from parley.config import run

        return getattr(run, name)
    if name == "Environment":
        from parley.environments.base import Environment

        return Environment
    raise AttributeError(f"module 'parley' has no attribute {name!r}")

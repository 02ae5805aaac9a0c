"""A newcomer's recipes, run as written: `source RUN_DIR/auth/<role>.env` hands the role's NATS user
to the commands the shell starts (the Slurm script's as_role does the same), and the deploy files
cite only documents and compose blocks that exist."""

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from parley.deploy.credentials import generate_credentials, k8s_secret, read_env_file

ROOT = Path(__file__).resolve().parents[2]
# a child process printing the PARLEY_ variables it was given
SHOW = (
    f"{sys.executable} -c 'import json, os; "
    'print(json.dumps({k: v for k, v in os.environ.items() if k.startswith("PARLEY_")}))\''
)


def child_env(script: str) -> dict[str, str]:
    """The PARLEY_ variables a child of `bash -c script` sees, from an environment without any."""
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"}
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_sourced_role_env_reaches_the_commands_the_shell_starts(tmp_path):
    creds = generate_credentials("r1", tmp_path / "auth")
    user, password = creds["actor"]
    seen = child_env(f"source {tmp_path}/auth/actor.env && {SHOW}")
    assert seen == {"PARLEY_NATS_USER": user, "PARLEY_NATS_PASSWORD": password}
    learner = child_env(f"source {tmp_path}/auth/learner.env && {SHOW}")
    assert learner["PARLEY_EVAL_NATS_USER"] == creds["eval"][0]


def test_parley_reads_the_env_files_it_writes(tmp_path):
    creds = generate_credentials("r1", tmp_path / "auth")
    env = read_env_file(tmp_path / "auth" / "scorer.env")
    assert env == dict(zip(("PARLEY_NATS_USER", "PARLEY_NATS_PASSWORD"), creds["scorer"]))
    secret = yaml.safe_load(k8s_secret(tmp_path / "auth"))["stringData"]
    assert (secret["judge-user"], secret["judge-password"]) == creds["judge"]
    # files written before the `export` lines still read
    (tmp_path / "old.env").write_text("PARLEY_NATS_USER=u\nPARLEY_NATS_PASSWORD=p\n")
    assert read_env_file(tmp_path / "old.env") == {"PARLEY_NATS_USER": "u", "PARLEY_NATS_PASSWORD": "p"}


def test_the_slurm_scripts_as_role_hands_the_user_to_its_command(tmp_path):
    creds = generate_credentials("r1", tmp_path / "auth")
    text = (ROOT / "deploy" / "slurm" / "run.sbatch").read_text()
    (function,) = re.findall(r"^as_role\(\) \{.*?^\}", text, re.S | re.M)
    seen = child_env(f"AUTH={tmp_path}/auth\n{function}\nas_role sim {SHOW}")
    assert (seen["PARLEY_NATS_USER"], seen["PARLEY_NATS_PASSWORD"]) == creds["sim"]


def test_no_file_cites_a_design_md_that_does_not_exist():
    if (ROOT / "DESIGN.md").exists():
        return
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    citing = []
    for name in tracked:
        path = ROOT / name
        if (
            name.startswith("bench/results")
            or name == "tests/unit/test_recipes.py"
            or path.suffix not in (".py", ".md", ".toml", ".yaml", ".sbatch", "")
        ):
            continue
        if path.is_file() and "DESIGN.md" in path.read_text(errors="replace"):
            citing.append(name)
    assert citing == [], f"these cite DESIGN.md, which does not exist: {citing}"


def test_compose_cites_only_blocks_it_defines():
    text = (ROOT / "deploy" / "compose.yaml").read_text()
    defined = set(yaml.safe_load(text))
    cited = set(re.findall(r"\bx-[a-z][\w-]*", text))
    assert cited <= defined, f"compose.yaml names {sorted(cited - defined)}, which it does not define"

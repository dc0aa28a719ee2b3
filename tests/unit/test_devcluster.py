"""Unit tests of the dev cluster's recipe, certificates, node builders and process handling.
Real processes and files; no control plane (that is tests/e2e/test_smoke.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from tessera.cli import main
from tessera.devcluster import build, certs
from tessera.devcluster.build import Binaries, BuildError
from tessera.devcluster.cluster import (
    ClusterError,
    DevCluster,
    Layout,
    Process,
    _http_ok,
    apiserver_argv,
    free_port,
    kubeconfig,
)
from tessera.devcluster.nodes import (
    DEFAULT_POOLS,
    GPU_RESOURCE,
    NodePool,
    node_manifests,
    parse_pool,
)

# ---- build recipe ---------------------------------------------------------------------------


def test_go_mod_mirrors_every_staging_module_at_the_matching_tag() -> None:
    go_mod = build.kubernetes_go_mod("v1.34.4")
    assert "require k8s.io/kubernetes v1.34.4\n" in go_mod
    replaces = [line.split() for line in go_mod.splitlines() if "=>" in line]
    assert len(replaces) == 31
    assert all(r[0] == r[2] and r[3] == "v0.34.4" for r in replaces)
    assert ["k8s.io/client-go", "=>", "k8s.io/client-go", "v0.34.4"] in replaces


def test_ldflags_stamp_both_version_packages() -> None:
    flags = build.kubernetes_ldflags("v1.34.4", "2026-01-01T00:00:00Z")
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        assert f"-X {pkg}.gitVersion=v1.34.4" in flags
        assert f"-X {pkg}.gitMajor=1" in flags
        assert f"-X {pkg}.gitMinor=34" in flags


@pytest.mark.parametrize("text, expected", [("go1.26.8", (1, 26)), ("go1.24rc1\n", (1, 24))])
def test_parse_go_version(text: str, expected: tuple[int, int]) -> None:
    assert build.parse_go_version(text) == expected


def test_parse_go_version_rejects_garbage() -> None:
    with pytest.raises(BuildError, match="cannot read a Go version"):
        build.parse_go_version("devel")


def test_missing_go_is_named_before_anything_is_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GO", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(build, "STANDARD_GO", tmp_path / "no-go")
    with pytest.raises(BuildError, match="Go toolchain not found"):
        build.ensure_binaries(root=tmp_path / "cache", progress=lambda _: None)
    assert not (tmp_path / "cache" / "kubectl").exists()


def test_go_env_var_that_is_not_executable_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GO", str(tmp_path / "missing-go"))
    with pytest.raises(BuildError, match="is not an executable file"):
        build.find_go()


def test_failed_step_names_itself_and_its_log(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "step.log"
    failing = [sys.executable, "-c", "print('compile error: boom'); raise SystemExit(3)"]
    with pytest.raises(BuildError) as err:
        build.run_step("kubernetes: build kube-apiserver", failing, log, cwd=tmp_path,
                       env={}, progress=lambda _: None)
    message = str(err.value)
    assert "'kubernetes: build kube-apiserver'" in message
    assert "exit code 3" in message
    assert str(log) in message
    assert "compile error: boom" in message


def test_binaries_report_what_is_missing(tmp_path: Path) -> None:
    binaries = Binaries.in_cache(tmp_path)
    binaries.etcd.parent.mkdir(parents=True)
    binaries.etcd.write_text("")
    missing = binaries.missing()
    assert binaries.etcd not in missing
    assert binaries.kube_apiserver in missing and len(missing) == 8


# ---- nodes ----------------------------------------------------------------------------------


def test_default_pools_make_two_ready_to_schedule_h200_nodes_each() -> None:
    nodes = node_manifests(DEFAULT_POOLS)
    assert [n["metadata"]["name"] for n in nodes] == [
        "h200-prefill-0", "h200-prefill-1", "h200-decode-0", "h200-decode-1"]
    for node in nodes:
        labels = node["metadata"]["labels"]
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H200"
        assert labels["tessera.dev/pool"] in {"prefill", "decode"}
        assert node["metadata"]["annotations"] == {"kwok.x-k8s.io/node": "fake"}
        assert node["status"]["allocatable"][GPU_RESOURCE] == "8"
        # local disk for the pods that fetch their weights (they request its size)
        assert node["status"]["allocatable"]["ephemeral-storage"] == "27Ti"
        assert node["status"]["capacity"] == node["status"]["allocatable"]


def test_parse_pool() -> None:
    assert parse_pool("decode=4", gpus_per_node=4) == NodePool("decode", nodes=4, gpus_per_node=4)


def test_a_pool_can_advertise_rdma_devices() -> None:
    pool = parse_pool("fabric=2,rdma/ib=8,rdma/roce=1")
    assert pool == NodePool("fabric", nodes=2, rdma={"rdma/ib": 8, "rdma/roce": 1})
    [node, _] = node_manifests((pool,))
    assert node["status"]["allocatable"] == node["status"]["capacity"]
    assert {k: v for k, v in node["status"]["allocatable"].items() if k.startswith("rdma/")} == {
        "rdma/ib": "8", "rdma/roce": "1"}
    assert all(not k.startswith("rdma/") for n in node_manifests(DEFAULT_POOLS)
               for k in n["status"]["allocatable"])


@pytest.mark.parametrize("spec", ["decode", "decode=", "decode=two", "=2", "decode=2,rdma/ib",
                                  "decode=2,rdma/ib=x"])
def test_parse_pool_rejects_malformed_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_pool(spec)


@pytest.mark.parametrize("pool, message", [
    (dict(name="Decode"), "not a DNS label"),
    (dict(name="decode", nodes=0), "nodes must be >= 1"),
    (dict(name="decode", gpus_per_node=-1), "gpus_per_node must be >= 0"),
    (dict(name="decode", rdma={"ib": 1}), "must be an extended resource name"),
    (dict(name="decode", rdma={"nvidia.com/gpu": 1}), "must be an extended resource name"),
])  # fmt: skip
def test_node_pool_validation(pool: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NodePool(**pool)  # type: ignore[arg-type]


def test_duplicate_pool_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        node_manifests((NodePool("decode"), NodePool("decode")))


# ---- certificates and configuration ----------------------------------------------------------


def test_certificates_chain_to_the_ca_and_carry_the_right_identities(tmp_path: Path) -> None:
    pki = certs.generate(tmp_path)
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    serving = x509.load_pem_x509_certificate(pki.serving_cert.read_bytes())
    admin = x509.load_pem_x509_certificate(pki.admin_cert.read_bytes())
    serving.verify_directly_issued_by(ca)
    admin.verify_directly_issued_by(ca)
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1", certs.SERVICE_IP}
    groups = admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    assert [g.value for g in groups] == ["system:masters"]
    assert oct(pki.admin_key.stat().st_mode & 0o777) == "0o600"


def test_kubeconfig_and_apiserver_flags_point_at_the_generated_files(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    pki = certs.generate(layout.pki)
    config = kubeconfig("https://127.0.0.1:6443", pki)
    assert config["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert config["users"][0]["user"]["client-key"] == str(pki.admin_key)
    argv = apiserver_argv(Path("kube-apiserver"), layout, pki, etcd_port=2379, port=6443)
    assert "--secure-port=6443" in argv
    assert "--etcd-servers=http://127.0.0.1:2379" in argv
    assert f"--audit-log-path={layout.audit_log}" in argv
    assert f"--client-ca-file={pki.ca_cert}" in argv


# ---- processes ------------------------------------------------------------------------------


def _wait_for_exec(pid: int, exe: str) -> None:
    """Until a new child has exec'd, its command line is still the forked parent's."""
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] != exe.encode():
        assert time.monotonic() < deadline, f"pid {pid} never exec'd {exe}"
        time.sleep(0.01)


def _http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]


def test_a_taken_port_is_retried_on_another(tmp_path: Path) -> None:
    cluster = DevCluster(Layout(tmp_path), Binaries.in_cache(tmp_path), DEFAULT_POOLS, [], 0,
                         detached=False)
    cluster.layout.logs.mkdir(parents=True)
    ports: list[int] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        candidates = iter([taken.getsockname()[1], free_port()])

        def prepare() -> tuple[list[str], object]:
            ports.append(next(candidates))
            url = f"http://127.0.0.1:{ports[-1]}/"
            return _http_server(ports[-1]), lambda: _http_ok(url)

        try:
            cluster._launch("web", prepare, deadline=time.monotonic() + 30)  # type: ignore[arg-type]
            assert len(ports) == 2
            assert [p.name for p in cluster.processes] == ["web"]
            assert _http_ok(f"http://127.0.0.1:{ports[1]}/")
        finally:
            cluster.stop()
    assert not tmp_path.exists()


def test_detached_processes_are_found_again_and_stopped_by_pid(tmp_path: Path) -> None:
    started = DevCluster(Layout(tmp_path), Binaries.in_cache(tmp_path), DEFAULT_POOLS, [], 0,
                         detached=True)
    started.layout.logs.mkdir(parents=True)
    proc = started._spawn("web", _http_server(free_port()))
    try:
        _wait_for_exec(proc.pid, sys.executable)
        started._write_state()
        found = DevCluster.attach(tmp_path, started.binaries)
        assert found is not None
        assert [(p.name, p.pid) for p in found.processes] == [("web", proc.pid)]
        assert found.processes[0].running()
        found.stop()
        assert proc.popen is not None and proc.popen.wait(timeout=5) is not None
        assert not tmp_path.exists()
    finally:
        proc.stop()


def test_a_recycled_pid_is_not_mistaken_for_ours() -> None:
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        _wait_for_exec(sleeper.pid, "sleep")
        assert Process("etcd", sleeper.pid, "/somewhere/else/etcd").running() is False
        assert Process("sleep", sleeper.pid, "sleep").running() is True
    finally:
        sleeper.kill()
        sleeper.wait()


# ---- CLI ------------------------------------------------------------------------------------


def test_cli_without_a_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = ["dev-cluster", "--state-dir", str(tmp_path / "state")]
    assert main([*state, "status"]) == 1
    assert "not up" in capsys.readouterr().out
    assert main([*state, "env"]) == 1
    assert "run `tessera dev-cluster up` first" in capsys.readouterr().err
    assert main([*state, "down"]) == 0
    assert "no dev cluster is up" in capsys.readouterr().out


def test_cli_rejects_a_malformed_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dev-cluster", "--state-dir", str(tmp_path), "up", "--pool", "decode"]) == 1
    assert "NAME=COUNT" in capsys.readouterr().err


def test_a_component_that_dies_is_named_with_its_log_kept(tmp_path: Path) -> None:
    binaries = Binaries.in_cache(tmp_path / "cache")
    for path in vars(binaries).values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\necho 'flag provided but not defined: -bogus'\nexit 2\n")
        path.chmod(0o755)
    state = tmp_path / "state"
    with pytest.raises(ClusterError) as err:
        DevCluster.create(state, binaries, timeout=20)
    log = state / "logs" / "etcd.log"
    assert f"etcd exited with code 2 before it was ready; log: {log}" in str(err.value)
    assert "flag provided but not defined" in log.read_text()
    assert not (state / "cluster.json").exists()

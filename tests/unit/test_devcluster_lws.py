"""LeaderWorkerSet in the dev cluster: its configuration, its webhooks on loopback, its cert."""

from __future__ import annotations

import base64
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from tessera.devcluster import certs
from tessera.devcluster.build import LWS_VERSION, Binaries
from tessera.devcluster.cluster import Layout, lws_argv, lws_config, lws_webhook_configurations


def test_lws_binaries_are_cached_by_version(tmp_path: Path) -> None:
    binaries = Binaries.in_cache(tmp_path)
    assert binaries.lws_controller == tmp_path / "lws" / LWS_VERSION / "bin" / "lws-controller"
    assert binaries.lws_crds == tmp_path / "lws" / LWS_VERSION / "crds.yaml"
    assert {binaries.lws_controller, binaries.lws_crds} <= set(binaries.missing())


def test_webhook_cert_is_for_loopback_and_signed_by_the_cluster_ca(tmp_path: Path) -> None:
    pki = certs.generate(tmp_path)
    assert (pki.webhook_cert.name, pki.webhook_key.name) == ("tls.crt", "tls.key")
    cert = x509.load_pem_x509_certificate(pki.webhook_cert.read_bytes())
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]


def test_lws_runs_alone_on_loopback_with_our_certificate(tmp_path: Path) -> None:
    pki = certs.generate(tmp_path / "pki")
    config = lws_config(pki, 9443)
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["internalCertManagement"] == {"enable": False}
    assert config["webhook"] == {"host": "127.0.0.1", "port": 9443,
                                 "certDir": str(pki.webhook_cert.parent)}
    assert config["metrics"]["bindAddress"] == "0"  # no listener beside the webhook
    assert config["health"]["healthProbeBindAddress"] == "0"
    layout = Layout(tmp_path)
    assert lws_argv(Path("/bin/lws"), layout) == [
        "/bin/lws", f"--config={layout.lws_config}", f"--kubeconfig={layout.kubeconfig}"]


def test_webhooks_are_called_by_url_with_the_cluster_ca_and_fail_closed() -> None:
    mutating, validating = lws_webhook_configurations(9443, b"CA PEM")
    assert mutating["kind"] == "MutatingWebhookConfiguration"
    assert validating["kind"] == "ValidatingWebhookConfiguration"
    hooks = {h["name"]: h for h in [*mutating["webhooks"], *validating["webhooks"]]}
    assert set(hooks) == {"mleaderworkerset.kb.io", "mpod.kb.io", "vleaderworkerset.kb.io",
                          "vpod.kb.io"}
    for hook in hooks.values():
        assert hook["failurePolicy"] == "Fail"  # validation stays on
        assert hook["clientConfig"]["url"].startswith("https://127.0.0.1:9443/")
        assert base64.b64decode(hook["clientConfig"]["caBundle"]) == b"CA PEM"
    assert hooks["mpod.kb.io"]["clientConfig"]["url"].endswith("/mutate--v1-pod")
    # Pod hooks only for pods of a LeaderWorkerSet: the rest of the cluster never waits on LWS.
    for name in ("mpod.kb.io", "vpod.kb.io"):
        assert hooks[name]["objectSelector"] == {"matchExpressions": [
            {"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}
    assert "objectSelector" not in hooks["vleaderworkerset.kb.io"]

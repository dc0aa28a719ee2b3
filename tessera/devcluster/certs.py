"""Fresh certificates for one dev cluster: a CA, the apiserver's serving cert, an admin client
cert (group system:masters), the service-account signing key and a serving cert for webhooks
on loopback (LeaderWorkerSet's). Written as PEM files."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The first address of the service range (10.0.0.0/24), which in-cluster clients dial.
SERVICE_IP = "10.0.0.1"
VALIDITY = dt.timedelta(days=30)


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path
    # In their own folder under the names controller-runtime's webhook server reads.
    webhook_cert: Path
    webhook_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def _issue(subject: x509.Name, key: ec.EllipticCurvePrivateKey, ca_name: x509.Name,
           ca_key: ec.EllipticCurvePrivateKey, *, is_ca: bool = False,
           usage: x509.ObjectIdentifier | None = None,
           sans: list[x509.GeneralName] | None = None) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def generate(directory: Path) -> Pki:
    """Create every key and certificate the cluster needs under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, serving_key, admin_key, webhook_key = _key(), _key(), _key(), _key()
    ca_name = _name("tessera-dev-ca")
    ca = _issue(ca_name, ca_key, ca_name, ca_key, is_ca=True)
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes.default.svc"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address(SERVICE_IP)),
    ]
    serving = _issue(_name("kube-apiserver"), serving_key, ca_name, ca_key,
                     usage=ExtendedKeyUsageOID.SERVER_AUTH, sans=sans)
    admin = _issue(_name("tessera-admin", "system:masters"), admin_key, ca_name, ca_key,
                   usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    # The API server calls webhooks at https://127.0.0.1:PORT and checks this cert.
    webhook = _issue(_name("tessera-dev-webhook"), webhook_key, ca_name, ca_key,
                     usage=ExtendedKeyUsageOID.SERVER_AUTH,
                     sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    webhook_dir = directory / "webhook"
    webhook_dir.mkdir(exist_ok=True)
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = serialization.Encoding.PEM
    return Pki(
        ca_cert=_write(directory / "ca.crt", ca.public_bytes(pem)),
        serving_cert=_write(directory / "apiserver.crt", serving.public_bytes(pem)),
        serving_key=_write(directory / "apiserver.key", _pem_key(serving_key)),
        admin_cert=_write(directory / "admin.crt", admin.public_bytes(pem)),
        admin_key=_write(directory / "admin.key", _pem_key(admin_key)),
        sa_key=_write(directory / "sa.key", _pem_key(sa_key)),
        sa_pub=_write(directory / "sa.pub", sa_key.public_key().public_bytes(
            pem, serialization.PublicFormat.SubjectPublicKeyInfo)),
        webhook_cert=_write(webhook_dir / "tls.crt", webhook.public_bytes(pem)),
        webhook_key=_write(webhook_dir / "tls.key", _pem_key(webhook_key)),
    )

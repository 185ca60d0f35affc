"""X.509 material for the local control plane: one CA, the API server's serving certificate,
an admin client certificate (group ``system:masters``) and the service-account key pair.

Called by :mod:`matrixpool.devcluster.cluster` on the first ``cluster up``; files are kept in the
cluster's state folder and reused on a warm start.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from matrixpool import clock

VALIDITY = datetime.timedelta(days=365)
# The user name of the admin certificate: whoever uses the kubeconfig, the operator included.
ADMIN_USER = "matrixpool-admin"


@dataclass(frozen=True)
class PKI:
    """Paths of the files written by :func:`ensure`."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path  # RSA private key that signs service-account tokens
    sa_pub: Path  # its public half, given to the API server for verification


def paths(folder: Path) -> PKI:
    """Where the PKI of ``folder`` lives (the files may not exist yet)."""
    names = (
        "ca.crt",
        "ca.key",
        "apiserver.crt",
        "apiserver.key",
        "admin.crt",
        "admin.key",
        "sa.key",
        "sa.pub",
    )
    return PKI(*(folder / name for name in names))


def ensure(folder: Path, server_ips: tuple[str, ...] = ()) -> PKI:
    """Write the PKI into ``folder`` unless it is already complete; return the paths.
    ``server_ips``: addresses the API server's certificate names beside loopback and the
    kubernetes Service's (the real nodes' gateway)."""
    folder.mkdir(parents=True, exist_ok=True)
    pki = paths(folder)
    if all(p.exists() for p in vars(pki).values()):
        return pki
    # The validity window starts a day early so clock skew never makes a cert "not yet valid".
    start = clock.SYSTEM.now() - datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "matrixpool-dev-ca")])
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), start)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(pki.ca_key, ca_key)
    pki.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _issue(
        pki.server_cert,
        pki.server_key,
        ca_cert,
        ca_key,
        start,
        "kube-apiserver",
        [],
        ExtendedKeyUsageOID.SERVER_AUTH,
        server=True,
        ips=server_ips,
    )
    _issue(
        pki.admin_cert,
        pki.admin_key,
        ca_cert,
        ca_key,
        start,
        ADMIN_USER,
        ["system:masters"],
        ExtendedKeyUsageOID.CLIENT_AUTH,
        server=False,
    )
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


def client_cert(folder: Path, name: str, groups: list[str]) -> tuple[Path, Path]:
    """A client certificate and key for user ``name`` in ``groups``, signed by the CA of
    ``folder`` (a real node's kubelet: ``system:node:<node>`` in ``system:nodes``)."""
    pki = paths(folder)
    cert, key = folder / f"{name.replace(':', '-')}.crt", folder / f"{name.replace(':', '-')}.key"
    if cert.exists() and key.exists():
        return cert, key
    ca_cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    start = clock.SYSTEM.now() - datetime.timedelta(days=1)
    _issue(
        cert,
        key,
        ca_cert,
        ca_key,
        start,
        name,
        groups,
        ExtendedKeyUsageOID.CLIENT_AUTH,
        server=False,
    )
    return cert, key


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: object, start: datetime.datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + VALIDITY)
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=not cert_sign,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _issue(
    cert_path: Path,
    key_path: Path,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    start: datetime.datetime,
    common_name: str,
    groups: list[str],
    usage: x509.ObjectIdentifier,
    *,
    server: bool,
    ips: tuple[str, ...] = (),
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
    subject = x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (
        _builder(subject, ca_cert.subject, key.public_key(), start)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        names: list[x509.GeneralName] = [
            x509.DNSName("localhost"),
            x509.DNSName("kubernetes"),
            x509.DNSName("kubernetes.default.svc"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("10.96.0.1")),
            *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips),
        ]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    _write_key(key_path, key)
    cert_path.write_bytes(
        builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)

"""Throwaway X.509 certificates for TLS tests (a CA, server and client certificates)."""

from __future__ import annotations

import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def certificate(common_name, issuer=None, *, ca=None, san=(), usage=None):
    """A PEM certificate and key for ``common_name``, signed by ``issuer`` (or self-signed).

    ``ca`` defaults to whether it is self-signed. Returns ``(cert_pem, key_pem, issuer)``,
    where ``issuer`` can sign further certificates.
    """
    if ca is None:
        ca = issuer is None
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    issuer_name, issuer_key = issuer if issuer is not None else (name, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(san)), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem, (name, key)


def make_tls_files(directory):
    """A CA, a server and a client certificate it signed, and an unrelated CA, as PEM files.

    Returns:
        dict: ``ca``, ``server_cert``, ``server_key``, ``client_cert``, ``client_key`` and
        ``other_ca`` (a CA that signed nothing here) mapped to file paths.
    """
    os.makedirs(directory, exist_ok=True)
    ca_pem, _, ca = certificate("synflow test CA", ca=True)
    other_ca_pem, _, _ = certificate("synflow unrelated CA", ca=True)
    server_pem, server_key, _ = certificate(
        "localhost", ca, san=(x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))),
        usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client_pem, client_key, _ = certificate("synflow-client", ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    paths = {}
    for name, data in (("ca", ca_pem), ("other_ca", other_ca_pem), ("server_cert", server_pem),
                       ("server_key", server_key), ("client_cert", client_pem), ("client_key", client_key)):
        paths[name] = os.path.join(directory, f"{name}.pem")
        with open(paths[name], "wb") as f:
            f.write(data)
        os.chmod(paths[name], 0o600)
    return paths

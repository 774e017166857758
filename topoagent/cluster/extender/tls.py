"""The extender's HTTPS: its own certificate, and the client certificates it asks for.

kube-scheduler cannot send an extender a bearer token, but its extender ``tlsConfig``
(``certFile``, ``keyFile``, ``caFile``) presents a client certificate.  With a client CA
the extender requires one of every caller (``CERT_REQUIRED``): a caller without a
certificate, or with one that does not verify against the CA, never completes the TLS
handshake, so it cannot hold a request open either.  kubelet's probes carry no
certificate: they reach /healthz and /readyz on the plain ``--probe-listen`` port, which
serves nothing else.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any

from topoagent.smallfile import read_small_file

MAX_PEM_BYTES = 1 << 20  # a certificate chain or a key is a few KiB

CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
PRIVATE_KEY = b"PRIVATE KEY-----"  # BEGIN PRIVATE KEY, BEGIN RSA/EC PRIVATE KEY, BEGIN ENCRYPTED PRIVATE KEY

# The subject's attribute names as openssl and kubectl print them.
SHORT_NAMES = {
    "commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU", "countryName": "C",
    "stateOrProvinceName": "ST", "localityName": "L", "emailAddress": "emailAddress",
}


class TLSFileError(ValueError):
    """A certificate, key or CA file the extender cannot serve with: one line naming the
    flag, the file and the problem."""


class _EncryptedKey(Exception):
    pass


def _no_password() -> bytes:
    # Called by OpenSSL only for an encrypted key; without it OpenSSL would prompt on the terminal.
    raise _EncryptedKey


def _read_pem(flag: str, path: str, marker: bytes, what: str) -> None:
    """Refuse a file that cannot be read or holds no PEM ``what``, before OpenSSL reads it
    (whose errors name neither the file nor the flag)."""
    try:
        raw, _ = read_small_file(path, MAX_PEM_BYTES)
    except OSError as exc:
        raise TLSFileError(f"{flag} {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_PEM_BYTES:
        raise TLSFileError(f"{flag} {path}: larger than {MAX_PEM_BYTES >> 10} KiB; expected PEM {what}")
    if marker not in raw:
        raise TLSFileError(f"{flag} {path}: no PEM {what} in it")


def server_context(cert_file: str, key_file: str, client_ca_file: str | None = None) -> ssl.SSLContext:
    """The listening socket's TLS: ``cert_file`` (the chain, leaf first) and its
    ``key_file``; with ``client_ca_file``, client certificates asked for and verified
    against it.  TLSFileError says what is wrong with which file."""
    _read_pem("--tls-cert-file", cert_file, CERTIFICATE, "certificate")
    _read_pem("--tls-key-file", key_file, PRIVATE_KEY, "private key")
    if client_ca_file is not None:
        _read_pem("--client-ca-file", client_ca_file, CERTIFICATE, "CA certificate")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # TLS 1.2 at least, no weak ciphers
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_password)
    except _EncryptedKey:
        raise TLSFileError(f"--tls-key-file {key_file}: the key is encrypted; give it unencrypted (a Secret mounted read-only holds it)") from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TLSFileError(f"--tls-key-file {key_file}: not the key of the certificate in --tls-cert-file {cert_file}") from None
        raise TLSFileError(f"--tls-cert-file {cert_file} / --tls-key-file {key_file}: {exc.reason or exc}") from None
    except OSError as exc:
        raise TLSFileError(f"--tls-cert-file {cert_file} / --tls-key-file {key_file}: {exc.strerror or exc}") from None
    if client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=client_ca_file)
        except ssl.SSLError as exc:
            raise TLSFileError(f"--client-ca-file {client_ca_file}: {exc.reason or exc}") from None
        except OSError as exc:
            raise TLSFileError(f"--client-ca-file {client_ca_file}: {exc.strerror or exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def peer_subject(peercert: Mapping[str, Any] | None) -> str:
    """The verified client certificate's subject as ``CN=...,O=...``, or "unauthenticated"
    (plain HTTP, HTTPS without --client-ca-file, or no certificate presented)."""
    if not peercert:
        return "unauthenticated"
    parts = []
    for rdn in peercert.get("subject", ()):
        for name, value in rdn:
            parts.append(f"{SHORT_NAMES.get(name, name)}={value}")
    return ",".join(parts) or "verified, empty subject"

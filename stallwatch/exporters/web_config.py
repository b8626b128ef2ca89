"""`--web.config.file`: TLS and basic auth for /metrics, in the Prometheus exporter toolkit's format.

    tls_server_config:
      cert_file: server.crt
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional, default NoClientCert
      client_ca_file: ca.crt                         # needed to verify client certificates
      min_version: TLS12                             # optional: TLS10, TLS11, TLS12, TLS13
    basic_auth_users:
      prometheus: $2b$12$...                         # bcrypt hashes, as `htpasswd -B` writes them

Relative paths are relative to the file. The file is read and checked once at start: every mistake
(unknown key, unreadable certificate, malformed hash) is a one-line `ConfigError`. The certificate, key
and client CA files are read again when they change (checked at each new connection), so a rotated
certificate (cert-manager, a renewed Secret) is served without a restart; a new set that does not load
(a key not yet written beside its certificate) is logged once and the previous one stays in use.

Of the toolkit's client_auth_type values, RequestClientCert and RequireAnyClientCert (ask for a
certificate without verifying it) have no equivalent in Python's ssl module and are refused rather
than weakened.

bcrypt is slow by design (~0.2 s a check at cost 12), so a successful (user, password) pair is kept,
as a SHA-256 digest, in a small cache: Prometheus repeats the same credentials every scrape. Everything
else costs a bcrypt check, unknown users included (against the costliest configured hash, so timing
does not tell which users exist); those checks run one at a time and a failed one holds the slot as
long again, so guessing threads cost the agent at most half a core and cannot starve scrapes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import ssl
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt

from stallwatch.exporters.config import ConfigError, load_yaml
from stallwatch.flags import shown

log = logging.getLogger(__name__)

_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_UNSUPPORTED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version"}
_TOP_KEYS = {"tls_server_config", "basic_auth_users"}
_CACHE_SIZE = 64
# How long a check waits for the bcrypt slot before it is refused (scrapes time out after 10 s).
_CHECK_QUEUE_SECONDS = 5.0
# How long a connection waits for a changed certificate to load before the previous one serves it.
RELOAD_WAIT_S = 1.0


class _Turns:
    """One holder at a time, handed on in the order they asked. threading's Lock and Semaphore let a newcomer
    take a just-released slot ahead of a thread that waited for it, so a guesser's next check could overtake a
    scrape again and again until its wait ran out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = False
        self._waiting: deque[threading.Lock] = deque()

    def acquire(self, timeout: float) -> bool:
        with self._lock:
            if not self._held:
                self._held = True
                return True
            turn = threading.Lock()
            turn.acquire()
            self._waiting.append(turn)
        if turn.acquire(timeout=timeout):
            return True
        with self._lock:
            if turn in self._waiting:
                self._waiting.remove(turn)
                return False
        return True  # handed over just as the wait ran out: the slot is ours

    def release(self) -> None:
        with self._lock:
            if self._waiting:
                self._waiting.popleft().release()  # still held: by the next in line
            else:
                self._held = False


@dataclass
class BasicAuth:
    users: Mapping[str, bytes]
    _verified: set[bytes] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # bcrypt checks that did not hit the cache run one at a time, so guessing costs at most one core
    # (half of one: a failed check holds the slot as long again), never every core the scrapes need. Each
    # client queues for that slot one check at a time: a guesser on many connections waits behind itself,
    # and a scraper from another address is next after at most one of its checks.
    _checking: _Turns = field(default_factory=_Turns)
    _clients: dict[str, list[Any]] = field(default_factory=dict)  # address -> [its lock, checks using it]

    def allows(self, authorization: str | None, client: str = "") -> bool:
        """Whether an `Authorization` header carries a known user and the password of its hash; `client` is
        the address it came from."""
        scheme, _, credentials = (authorization or "").partition(" ")
        if scheme.lower() != "basic" or not credentials:  # RFC 7617: the scheme is case-insensitive
            return False
        try:
            user, sep, password = base64.b64decode(credentials.strip(), validate=True).decode().partition(":")
        except ValueError:  # not base64 (binascii.Error), not UTF-8, or a non-ASCII header
            return False
        if not sep:
            return False
        hashed = self.users.get(user)
        # An unknown user is checked against the costliest hash, so timing does not tell who exists.
        against = hashed if hashed is not None else max(self.users.values(), key=_cost)
        digest = hashlib.sha256(against + b"\0" + password.encode()).digest()
        if hashed is not None:
            with self._lock:
                if any(hmac.compare_digest(digest, known) for known in self._verified):
                    return True
        matches = self._checked(password, against, client, known=hashed is not None)
        if matches:
            with self._lock:
                if len(self._verified) >= _CACHE_SIZE:
                    self._verified.clear()
                self._verified.add(digest)
        return matches


    def _checked(self, password: str, against: bytes, client: str, known: bool) -> bool:
        """The bcrypt check of a known user's password, in the client's turn then the node's; False when either
        wait runs out. A failed check holds the slot as long again."""
        with self._lock:
            turn = self._clients.setdefault(client, [threading.Lock(), 0])
            turn[1] += 1
        try:
            if not turn[0].acquire(timeout=_CHECK_QUEUE_SECONDS):
                return False
            try:
                if not self._checking.acquire(_CHECK_QUEUE_SECONDS):
                    return False
                try:
                    started = time.monotonic()
                    matches = bcrypt.checkpw(password.encode(), against) and known
                    if not matches:
                        time.sleep(time.monotonic() - started)
                    return matches
                finally:
                    self._checking.release()
            finally:
                turn[0].release()
        finally:
            with self._lock:
                turn[1] -= 1
                if turn[1] == 0:
                    del self._clients[client]


def _cost(hashed: bytes) -> int:
    return int(hashed[4:6])  # $2b$12$...: the log2 of bcrypt's rounds


class ReloadingTLS:
    """The TLS context of a `tls_server_config`, rebuilt when one of its files changes."""

    def __init__(self, section: Mapping[str, Any], file: Path):
        self._section, self._file = section, file
        self._lock = threading.Lock()
        self._stamp = self._stamps()
        self._context = _tls_context(section, file)
        self._check: threading.Thread | None = None

    def context(self) -> ssl.SSLContext:
        """The context, reloaded first if a file changed. The check runs on a thread of its own, waited for
        `RELOAD_WAIT_S`: a file that blocks (a FIFO, a hung mount) leaves the previous context in use, and
        while that check is stuck, connections are served at once and no other check starts."""
        with self._lock:
            if self._check is not None and self._check.is_alive():
                return self._context
            check = self._check = threading.Thread(target=self._reload_if_changed, name="tls-reload", daemon=True)
            check.start()
        check.join(RELOAD_WAIT_S)
        return self._context

    def _reload_if_changed(self) -> None:
        stamp = self._stamps()
        if stamp == self._stamp:
            return
        self._stamp = stamp  # a set that fails is tried again only once a file changes again
        try:
            self._context = _tls_context(self._section, self._file)
            log.info("web config: TLS certificate files changed; reloaded")
        except ConfigError as error:
            log.warning("web config: %s; serving the previous certificate", error)

    def _stamps(self) -> tuple[tuple[int, int, int] | None, ...]:
        """What tells a changed file: inode (Kubernetes swaps a symlink), size and mtime, per file."""
        stamps: list[tuple[int, int, int] | None] = []
        for key in ("cert_file", "key_file", "client_ca_file"):
            try:
                info = os.stat(_resolve(self._section, self._file, key)) if self._section.get(key) else None
            except OSError:
                info = None
            stamps.append((info.st_ino, info.st_size, info.st_mtime_ns) if info else None)
        return tuple(stamps)


@dataclass(frozen=True)
class WebConfig:
    tls: ReloadingTLS | None = None
    auth: BasicAuth | None = None


def load_web_config(path: str) -> WebConfig:
    file = Path(path)
    document = load_yaml(path)
    if document is None:
        return WebConfig()
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping with tls_server_config and/or basic_auth_users")
    unknown = set(map(str, document)) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown key {shown(sorted(unknown)[0])} (known: {', '.join(sorted(_TOP_KEYS))})")
    tls = document.get("tls_server_config")
    users = document.get("basic_auth_users")
    return WebConfig(
        tls=ReloadingTLS(_checked_tls_section(tls, file), file) if tls is not None else None,
        auth=_basic_auth(users, path) if users else None,
    )


def _checked_tls_section(section: Any, file: Path) -> Mapping[str, Any]:
    where = f"{file}: tls_server_config"
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = set(map(str, section)) - _TLS_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key {shown(sorted(unknown)[0])}")
    return section


def _resolve(section: Mapping[str, Any], file: Path, key: str) -> str:
    return str(file.parent / str(section[key]))


def _tls_context(section: Mapping[str, Any], file: Path) -> ssl.SSLContext:
    where = f"{file}: tls_server_config"
    if not section.get("cert_file") or not section.get("key_file"):
        raise ConfigError(f"{where}: cert_file and key_file are both required")
    client_auth = str(section.get("client_auth_type") or "NoClientCert")
    if client_auth in _UNSUPPORTED_CLIENT_AUTH:
        raise ConfigError(f"{where}: client_auth_type {client_auth} (a certificate without verification) is not "
                          "supported; use VerifyClientCertIfGiven or RequireAndVerifyClientCert")
    if client_auth not in _CLIENT_AUTH:
        raise ConfigError(f"{where}: client_auth_type must be one of {', '.join(_CLIENT_AUTH)}")
    min_version = str(section.get("min_version") or "TLS12")
    if min_version not in _VERSIONS:
        raise ConfigError(f"{where}: min_version must be one of {', '.join(_VERSIONS)}")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _VERSIONS[min_version]
    try:
        context.load_cert_chain(_resolve(section, file, "cert_file"), _resolve(section, file, "key_file"))
    except (OSError, ssl.SSLError) as error:
        raise ConfigError(f"{where}: cannot load cert_file/key_file: {_reason(error)}") from error
    context.verify_mode = _CLIENT_AUTH[client_auth]
    if context.verify_mode != ssl.CERT_NONE:
        if not section.get("client_ca_file"):
            raise ConfigError(f"{where}: client_auth_type {client_auth} needs client_ca_file")
        try:
            context.load_verify_locations(_resolve(section, file, "client_ca_file"))
        except (OSError, ssl.SSLError) as error:
            raise ConfigError(f"{where}: cannot load client_ca_file: {_reason(error)}") from error
    return context


def _basic_auth(section: Any, path: str) -> BasicAuth:
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: basic_auth_users: expected a mapping of user names to bcrypt hashes")
    users: dict[str, bytes] = {}
    for user, hashed in section.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")) or len(hashed) != 60:
            raise ConfigError(f"{path}: basic_auth_users: the hash of {shown(user)} is not a bcrypt hash")
        users[str(user)] = hashed.encode()
    return BasicAuth(users)


def _reason(error: OSError | ssl.SSLError) -> str:
    return str(getattr(error, "reason", None) or error.strerror or error)

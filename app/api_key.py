"""Optional API key for the HTTP API: `Authorization: Bearer <key>`, as OpenAI clients send it.

Off unless the router's environment sets one of (never the Serve config, which `serve status`,
the dashboard and the RayService object show to anyone who can read them):
- SPECSERVE_API_KEY: the key itself (e.g. from a Kubernetes Secret through `env`);
- SPECSERVE_API_KEY_FILE: a file of keys, one per line (blank lines and `#` comments ignored;
  several keys let a rotation overlap). Re-read when its modification time changes, so a mounted
  Secret rotates without a restart.
Both may be set: either's keys are accepted. A set variable that yields no key (empty value, a
missing or empty file) is an error at startup: the operator meant to lock the API down.

Keys are compared in constant time (hmac.compare_digest). Ray-free; the router's ASGI middleware
(deployments/router.py) calls `ApiKeys.check`.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

ENV_KEY = "SPECSERVE_API_KEY"
ENV_KEY_FILE = "SPECSERVE_API_KEY_FILE"
# Paths served without a key: liveness/readiness (/health), the playground page itself (its API
# calls need the key like any client's) and the OpenAPI docs (no data).
OPEN_PATHS: frozenset[str] = frozenset({"/health", "/", "/docs", "/docs/oauth2-redirect", "/openapi.json"})


@dataclass(frozen=True)
class AuthFailure:
    """Why a request is refused: OpenAI's 401 body fields."""

    message: str
    code: str | None


MISSING = AuthFailure(
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).", None)
INVALID = AuthFailure("Incorrect API key provided.", "invalid_api_key")


def _parse_keys(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


class ApiKeys:
    def __init__(self, keys: list[str] | None = None, key_file: str | Path | None = None) -> None:
        self._static = [k.encode() for k in (keys or [])]
        self._file = Path(key_file) if key_file else None
        self._file_mtime: float | None = None
        self._file_keys: list[bytes] = []
        if self._file is not None:
            self._reload_file()
        if self.enabled and not self._static and not self._file_keys:
            raise ValueError(f"{ENV_KEY_FILE}={self._file} holds no key")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ApiKeys":
        env = os.environ if env is None else env
        key = env.get(ENV_KEY)
        if key is not None and not key.strip():
            raise ValueError(f"{ENV_KEY} is set but empty")
        return cls([key.strip()] if key else None, env.get(ENV_KEY_FILE) or None)

    @property
    def enabled(self) -> bool:
        return bool(self._static) or self._file is not None

    def _reload_file(self) -> None:
        assert self._file is not None
        mtime = self._file.stat().st_mtime  # a missing file raises: at startup that is the point
        if mtime != self._file_mtime:
            self._file_keys = [k.encode() for k in _parse_keys(self._file.read_text())]
            self._file_mtime = mtime

    def _keys(self) -> list[bytes]:
        if self._file is not None:
            try:
                self._reload_file()
            except OSError:
                pass  # a Secret mid-rotation (symlink swap): keep the keys last read
        return self._static + self._file_keys

    def check(self, authorization: str | None) -> AuthFailure | None:
        """None when the Authorization header carries a valid key (or no key is configured)."""
        if not self.enabled:
            return None
        if not authorization:
            return MISSING
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return MISSING
        given = token.encode()
        ok = False
        for key in self._keys():  # no early exit: the time taken does not depend on which key matched
            ok |= hmac.compare_digest(given, key)
        return None if ok else INVALID


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS

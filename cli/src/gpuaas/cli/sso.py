"""`gpuaas login --sso`: the browser flow with a loopback redirect (RFC 8252).

The CLI listens on 127.0.0.1 on a random port, starts the SSO login with `return_to` pointing at that
listener (plus a random `cli_state` it checks on the way back), prints (and opens) the URL, and waits.
The identity service sends the browser back with a single-use `login_code` (never the tokens), which
the CLI exchanges at `POST /auth/token` (grant_type=sso_login_code).

The code is bound to this process (RFC 7636 S256): the start carries the SHA-256 of a random
`code_verifier` that never leaves the process until the exchange, so a login code seen elsewhere (the
browser's history, a log) cannot be redeemed by anyone else.
"""

from __future__ import annotations

import base64
import hashlib
import html
import queue
import secrets
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

PATH = "/callback"


def s256(verifier: str) -> str:
    """RFC 7636 S256: base64url (unpadded) of the verifier's SHA-256."""
    return base64.urlsafe_b64encode(hashlib.sha256(verifier.encode("ascii")).digest()).rstrip(b"=").decode()


class LoopbackListener:
    """A one-shot HTTP listener on 127.0.0.1:<random port> that hands the callback's query to `wait`;
    it also holds this login's PKCE `code_verifier` (64 random bytes: 86 base64url characters)."""

    def __init__(self) -> None:
        self.state = secrets.token_urlsafe(16)
        self.code_verifier = secrets.token_urlsafe(64)
        self._results: queue.Queue[dict[str, str]] = queue.Queue(maxsize=1)
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                if parts.path != PATH or query.get("cli_state") != listener.state:
                    self._page(404, "Not the sign-in this command is waiting for.")
                    return
                if query.get("error"):
                    self._page(400, f"Sign-in failed: {query.get('error_description') or query['error']}.")
                else:
                    self._page(200, "Signed in: you can close this window and go back to the terminal.")
                try:
                    listener._results.put_nowait(query)
                except queue.Full:
                    pass

            def _page(self, status: int, message: str) -> None:
                body = (
                    "<!doctype html><html><head><meta charset=utf-8><title>GPUaaS sign-in</title></head>"
                    f"<body><p>{html.escape(message)}</p></body></html>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = HTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def redirect_uri(self) -> str:
        port = self._server.server_address[1]
        return f"http://127.0.0.1:{port}{PATH}?{urlencode({'cli_state': self.state})}"

    def __enter__(self) -> LoopbackListener:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait(self, timeout_s: float) -> dict[str, str]:
        """The callback's query parameters (`login_code`, or `error` + `error_description`)."""
        try:
            return self._results.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no sign-in came back within {timeout_s:.0f}s") from None


def start_url(sso_start_url: str, *, email: str, return_to: str, code_verifier: str) -> str:
    """The discovery's `sso_start_url` with the login hint, the loopback return_to and the S256
    challenge of `code_verifier`."""
    parts = urlsplit(sso_start_url)
    query: dict[str, Any] = {k: v[0] for k, v in parse_qs(parts.query).items()}
    query.update(email=email, return_to=return_to, code_challenge=s256(code_verifier), code_challenge_method="S256")
    return urlunsplit(parts._replace(query=urlencode(query)))

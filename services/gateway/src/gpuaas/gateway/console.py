"""The web console: a static single-page app (built by `npm run build` in web/console) served at `/`.

`console_dir` (setting) names the folder holding the build (`index.html` + `assets/`). Left unset, the
gateway looks for `web/console/dist` in the working directory and above its own source (the workspace
checkout); an empty string turns the console off. Without a build, `/` stays the placeholder page.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import Scope

RELATIVE = Path("web") / "console" / "dist"
# The console talks only to this origin (API, SSE, WebSocket); xterm.js sets inline styles.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self' ws: wss:; font-src 'self' data:; frame-ancestors 'none'; base-uri 'self'; "
    "form-action 'self'"
)


def find_console(setting: str | None) -> Path | None:
    if setting is not None:
        if not setting.strip():
            return None
        candidates = [Path(setting)]
    else:
        here = Path(__file__).resolve()
        candidates = [Path.cwd() / RELATIVE, *(parent / RELATIVE for parent in here.parents)]
    for candidate in candidates:
        if (candidate / "index.html").is_file():
            return candidate.resolve()
    return None


class _Assets(StaticFiles):
    """Hashed file names: cache them for good."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        if response.status_code == 200:
            response.headers["Cache-Control"] = "public, max-age=31536000, immutable"
        return response


def install(app: FastAPI, directory: Path) -> None:
    app.state.console_dir = directory
    if (directory / "assets").is_dir():
        app.mount("/assets", _Assets(directory=directory / "assets"), name="console-assets")


def index_response(request: Request) -> Response | None:
    directory: Path | None = getattr(request.app.state, "console_dir", None)
    if directory is None:
        return None
    response = FileResponse(directory / "index.html", media_type="text/html")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response

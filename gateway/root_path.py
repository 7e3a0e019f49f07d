"""`--root-path`: Lockgate served under a path prefix by a proxy. `RootPath` is the outermost
middleware, so every other one sees the same scope whichever way the request came (prefixed
or stripped by the proxy), and reads the route's own path with `route_path`: an upload limit,
the drain's open paths and the metrics' route labels are the same with and without a prefix."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class RootPath:
    """The app served under `root_path` ("/ops"): a request arrives with the prefix (straight
    from a browser) or without it (a proxy that strips it), and goes on with it in its path and
    `root_path` set, as ASGI has it, so routes match and the URLs written carry the prefix."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            path: str = scope["path"]
            if not (path == self.root or path.startswith(self.root + "/")):
                path = self.root + path
            scope = {**scope, "path": path, "root_path": self.root}
        await self.app(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The path a route matches: the request's path without the scope's `root_path`."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path

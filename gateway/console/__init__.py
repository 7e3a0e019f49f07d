"""The admin console at /console: server-rendered pages (Jinja2, autoescaped), our own CSS and
a few lines of our own JS, nothing fetched at run time. Signed in with an admin or viewer key
(`signin`), it shows and changes what the /admin/v1 routes do, through the same authorization
(`actions`, `caller.may`) and the same service functions (`admin_service`).

    install(app)      # what create_app does unless LOCKGATE_CONSOLE=false
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from lockgate.gateway.console import model_pages, report_pages, signin, tenant_pages
from lockgate.gateway.console.web import HERE


def install(app: FastAPI) -> None:
    """The console's routes and its static files (the security headers and the root path
    are middleware, added by `create_app`)."""
    for pages in (signin, tenant_pages, report_pages, model_pages):
        app.include_router(pages.router)
    app.mount("/console/static", StaticFiles(directory=HERE / "static"), name="console_static")

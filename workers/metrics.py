"""``/metrics`` on the API port: Prometheus exposition of the whole deployment.

Runs in each gunicorn worker (a scrape lands on whichever worker accepts it).
The numbers are the supervisor's (``shmkv.core.metrics``): its arena, and the sums of
what every worker reported, dead ones included, so any worker gives the same
answer and one scrape target covers the deployment.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from shmkv_workers.tenants import authenticate

from shmkv.core.config import Settings
from shmkv.core.metrics import registry_for


def add_metrics_route(app: Any, settings: Settings) -> None:
    """Add ``GET /metrics`` to the FastAPI ``app``; with ``--api-key``, for those keys only
    (the numbers tell which models and tenants are served, and how busy they are)."""
    from fastapi import Depends, Response

    registry = registry_for(settings)
    auth = [Depends(authenticate(settings.api_key))]

    @app.get("/metrics", tags=["shmkv"], include_in_schema=False, dependencies=auth)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

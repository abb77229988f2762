"""``GET /metrics``: the scheduler's page (fetched) followed by the frontend's own
families (``frontend.http.metrics``), ``vllm:admission_rejections`` written once."""

from __future__ import annotations

from aiohttp import web

from frontend.engine.admission import AdmissionControl, merge_rejections
from frontend.engine.scheduler_http import SchedulerHTTP
from frontend.http.metrics import FrontendMetrics, family_names

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def metrics_route(metrics: FrontendMetrics, scheduler: SchedulerHTTP, admission: AdmissionControl) -> tuple[str, str, object]:
    async def get_metrics(_request: web.Request) -> web.Response:
        # NOTE: the frontend's rejection counts go into the scheduler's lines (frontend/engine/admission.py).
        page = merge_rejections(await scheduler.metrics(), admission.rejections)
        return web.Response(body=page + metrics.render(family_names(page)), headers={"Content-Type": CONTENT_TYPE})

    return ("GET", "/metrics", get_metrics)

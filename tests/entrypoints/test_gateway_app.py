"""create_app wiring: LLM + diffusion model listing, health across runtimes, routers."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from tests.entrypoints.gateway_fakes import FakeEngine


class _DiffusionStub:
    """Only what the gateway itself touches: model listing and health."""

    def __init__(self) -> None:
        self.healthy = True

    def list_models(self) -> list[dict[str, Any]]:
        return [{"id": "tiny-flux", "object": "model", "owned_by": "genserve",
                 "kind": "diffusion", "task": "text-to-image"}]

    def is_healthy(self) -> bool:
        return self.healthy

    def runtime_report(self) -> dict[str, Any]:
        return {"state": "ready" if self.healthy else "restarting", "pid": 7, "restarts": 0}


def test_models_and_health_cover_both_runtimes():
    diffusion = _DiffusionStub()
    app = create_app(GatewayConfig(served_model_names=("alias",)),
                     [FakeEngine("llm-a"), FakeEngine("llm-b")], diffusion)
    client = TestClient(app)
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["kind"]) for m in models] == [
        ("llm-a", "llm"), ("llm-b", "llm"), ("alias", "llm"), ("tiny-flux", "diffusion")]
    assert models[3]["task"] == "text-to-image"
    r = client.post("/v1/completions", json={"model": "llm-b", "prompt": "x", "max_tokens": 2})
    assert r.json()["model"] == "llm-b" and r.json()["choices"][0]["text"] == "ab"
    assert client.post("/v1/completions", json={"model": "alias", "prompt": "x",
                                                 "max_tokens": 1}).status_code == 200
    assert client.get("/health").status_code == 200
    diffusion.healthy = False
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["components"]["diffusion"] is False
    assert r.json()["runtimes"]["diffusion"]["state"] == "restarting"
    assert r.json()["runtimes"]["llm-a"] == {"state": "ready"}
    paths = set(app.openapi()["paths"])
    assert {"/generate", "/v1/chat/completions", "/metrics"} <= paths
    assert "/v1/images/generations" in paths and "/v1/videos" in paths


def test_diffusion_routes_only_with_a_diffusion_client():
    client = TestClient(create_app(GatewayConfig(), [FakeEngine()]))
    r = client.post("/v1/images/generations", json={"prompt": "a cat"})
    assert r.status_code == 404 and "Unknown route" in r.json()["error"]["message"]
    assert client.get("/v1/videos").status_code == 404
    # The web UI is served all the same (it opens on its chat panel).
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert client.get("/ui/chat.js").status_code == 200

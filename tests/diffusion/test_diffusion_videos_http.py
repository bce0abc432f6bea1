"""/v1/videos jobs over a real uvicorn server with the embedded tiny-wan model."""

from __future__ import annotations

import time

import pytest

from genserve.multimodal_gen.encoding import probe_mp4
from tests.diffusion.helpers import error_of

FAST = {"model": "tiny-wan", "size": "32x32", "num_inference_steps": 2}


def create(http, **kw):
    return http.post("/v1/videos", json={"prompt": "a bird flying", **FAST, **kw})


def wait_for(http, video_id, statuses, timeout=60.0):
    seen = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = http.get(f"/v1/videos/{video_id}").json()
        seen.append((job["status"], job["progress"]))
        if job["status"] in statuses:
            return job, seen
        time.sleep(0.02)
    raise AssertionError(f"job {video_id} never reached {statuses}: {seen[-5:]}")


def test_job_lifecycle_and_mp4(http, server, tmp_path, monkeypatch):
    # What a poll would read after each worker event, recorded on the server (a poll every
    # few ms misses the steps on a fast machine).
    videos = server.app.state.gateway.videos
    after_events, on_event = [], videos._on_event

    async def recording(job, event):
        await on_event(job, event)
        after_events.append((job.id, job.status, job.progress))

    monkeypatch.setattr(videos, "_on_event", recording)
    r = create(http, num_inference_steps=12, num_frames=9, fps=8, seed=4)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "video" and job["status"] == "queued" and job["progress"] == 0
    done, _ = wait_for(http, job["id"], ("completed", "failed"))
    assert done["status"] == "completed" and done["progress"] == 100, done
    # One in_progress reading per denoising step, rising strictly, then completed at 100.
    mine = [(s, p) for jid, s, p in after_events if jid == job["id"]]
    running = [p for s, p in mine if s == "in_progress"]
    assert running == [int(100 * k / 12) for k in range(1, 12)] + [99], mine
    assert mine[-1] == ("completed", 100), mine
    assert done["seconds"] == "1.125" and done["completed_at"] >= done["created_at"]
    content = http.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    path = tmp_path / "v.mp4"
    path.write_bytes(content.content)
    assert probe_mp4(path) == {"faststart": True, "codec": "h264", "pix_fmt": "yuv420p",
                               "fps": 8.0, "num_frames": 9, "width": 32, "height": 32}
    listed = http.get("/v1/videos").json()
    assert listed["object"] == "list" and job["id"] in [j["id"] for j in listed["data"]]
    # Deleting a finished job removes it and its file.
    gone = http.delete(f"/v1/videos/{job['id']}").json()
    assert gone == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert http.get(f"/v1/videos/{job['id']}").status_code == 404
    assert http.get(f"/v1/videos/{job['id']}/content").status_code == 404


def test_seconds_maps_to_frames(http):
    job = create(http, seconds=1, fps=8).json()
    assert job["num_frames"] == 9
    done, _ = wait_for(http, job["id"], ("completed", "failed"))
    assert done["status"] == "completed"


def test_cancel_mid_way_then_next_job_runs(http):
    long = create(http, size="64x64", num_frames=17, num_inference_steps=100).json()
    wait_for(http, long["id"], ("in_progress",))
    r = http.delete(f"/v1/videos/{long['id']}")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    job = http.get(f"/v1/videos/{long['id']}").json()
    assert job["status"] == "cancelled" and job["progress"] < 100
    content = http.get(f"/v1/videos/{long['id']}/content")
    assert content.status_code == 409 and "cancelled" in error_of(content)["message"]
    nxt = create(http).json()
    done, _ = wait_for(http, nxt["id"], ("completed", "failed"), timeout=30)
    assert done["status"] == "completed"


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_openai_client_creates_a_video(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
    video = client.videos.create(model="tiny-wan", prompt="a bird", size="32x32",
                                 extra_body={"num_inference_steps": 2, "num_frames": 5})
    assert video.status == "queued"
    for _ in range(300):
        video = client.videos.retrieve(video.id)
        if video.status in ("completed", "failed"):
            break
        time.sleep(0.05)
    assert video.status == "completed"
    assert client.videos.download_content(video.id).content[4:8] == b"ftyp"


@pytest.mark.parametrize("kw, status, words", [
    (dict(num_frames=8), 400, ["num_frames 8", "4k+1", "5 or 9"]),
    (dict(seconds=1.1, fps=8), 400, ["seconds=1.1", "4k+1", "num_frames"]),
    (dict(seconds=1, num_frames=9), 400, ["not both"]),
    (dict(size="30x30"), 400, ["multiple of 16"]),
    (dict(size="512x512"), 400, ["over the cap"]),
    (dict(num_inference_steps=1000), 400, ["num_inference_steps"]),
    (dict(fps="fast"), 400, ["fps"]),
    (dict(model="tiny-flux"), 400, ["text-to-image"]),
    (dict(model="nope"), 404, ["nope"]),
])
def test_bad_input_is_an_actionable_error(http, kw, status, words):
    r = create(http, **kw)
    assert r.status_code == status, r.text
    message = error_of(r)["message"]
    for word in words:
        assert word in message, message


def test_unknown_job_is_404(http):
    for method, path in (("GET", "/v1/videos/video_nope"), ("GET", "/v1/videos/video_nope/content"),
                         ("DELETE", "/v1/videos/video_nope")):
        r = http.request(method, path)
        assert r.status_code == 404 and "video_nope" in error_of(r)["message"]

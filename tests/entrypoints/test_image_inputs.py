"""Image sources of vision requests: data URLs and base64 decode, http(s) URLs only from the
allow-list and never to non-public addresses (checked on the resolved IP, redirects included),
size and pixel caps. DNS and the network are replaced, so no connection leaves the machine."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib

import httpx
import pytest

from genserve.srt.multimodal.image_source import (
    ImageFetchPolicy,
    ImageInputError,
    decode_inline,
    is_public_address,
    load_image_bytes,
    open_image,
)

PUBLIC_IP = "93.184.216.34"


def png(width: int = 8, height: int = 6) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


class Net:
    """A fake DNS and web: records every request; nothing touches a socket."""

    def __init__(self, dns: dict[str, list[str]], routes: dict[str, httpx.Response]):
        self.dns, self.routes, self.requests = dns, routes, []

    async def resolve(self, host: str, port: int) -> list[str]:
        if host not in self.dns:
            raise OSError("no such host")
        return self.dns[host]

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        key = f"{request.headers['host']}{request.url.path}"
        return self.routes.get(key, httpx.Response(404))

    def load(self, url: str, policy: ImageFetchPolicy) -> bytes:
        return asyncio.run(load_image_bytes(url, policy, self.resolve,
                                            httpx.MockTransport(self.handler)))


ALLOW = ImageFetchPolicy(allowed_domains=("images.example.com", "cdn.example.org"))


def test_data_urls_and_base64_decode():
    raw = png()
    assert decode_inline(data_url(raw)) == raw
    assert decode_inline(base64.b64encode(raw).decode()) == raw
    assert decode_inline("https://images.example.com/a.png") is None
    with pytest.raises(ImageInputError, match="image/\\* type"):
        decode_inline(data_url(raw, "text/html"))
    with pytest.raises(ImageInputError, match="not valid base64|neither"):
        decode_inline("this is not base64!")
    with pytest.raises(ImageInputError, match="scheme 'file'"):
        decode_inline("file:///etc/passwd")
    with pytest.raises(ImageInputError, match="byte limit"):
        decode_inline(base64.b64encode(b"x" * 5000).decode(), max_bytes=1024)


@pytest.mark.parametrize("ip,public", [
    ("8.8.8.8", True), (PUBLIC_IP, True), ("2606:4700::1111", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.9", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("::1", False),
    ("fe80::1", False), ("fd00:ec2::254", False), ("::ffff:127.0.0.1", False),
    ("224.0.0.1", False),
])
def test_public_address_table(ip, public):
    assert is_public_address(ip) is public


def test_urls_need_an_allow_list():
    net = Net({"images.example.com": [PUBLIC_IP]}, {})
    with pytest.raises(ImageInputError, match="--allowed-image-domains"):
        net.load("https://images.example.com/a.png", ImageFetchPolicy())
    with pytest.raises(ImageInputError, match="not in this server's --allowed-image-domains"):
        net.load("https://evil.example.net/a.png", ALLOW)
    assert net.requests == []


def test_allowed_fetch_connects_to_the_checked_ip():
    raw = png()
    net = Net({"images.example.com": [PUBLIC_IP]},
              {"images.example.com/cat.png": httpx.Response(200, content=raw)})
    assert net.load("https://images.example.com/cat.png", ALLOW) == raw
    (req,) = net.requests
    assert req.url.host == PUBLIC_IP and req.headers["host"] == "images.example.com"
    assert req.extensions["sni_hostname"] == "images.example.com"
    sub = Net({"a.cdn.example.org": [PUBLIC_IP]},
              {"a.cdn.example.org/x.png": httpx.Response(200, content=raw)})
    assert sub.load("http://a.cdn.example.org/x.png", ALLOW) == raw


@pytest.mark.parametrize("ip", ["127.0.0.1", "10.0.0.5", "169.254.169.254", "::1",
                                "fd00:ec2::254"])
def test_names_resolving_to_private_addresses_are_never_connected(ip):
    net = Net({"images.example.com": [PUBLIC_IP, ip]}, {})
    with pytest.raises(ImageInputError, match="non-public address"):
        net.load("https://images.example.com/a.png", ALLOW)
    assert net.requests == []
    with pytest.raises(ImageInputError, match="non-public address"):
        Net({}, {}).load(f"http://{ip if ':' not in ip else f'[{ip}]'}/a.png",
                         ImageFetchPolicy(allowed_domains=("*",)))


def test_redirects_are_checked_like_the_first_url():
    raw = png()
    to_private = Net(
        {"images.example.com": [PUBLIC_IP], "internal.example.com": ["10.0.0.7"]},
        {"images.example.com/a.png": httpx.Response(
            302, headers={"location": "http://internal.example.com/secret"})})
    with pytest.raises(ImageInputError, match="non-public"):
        to_private.load("https://images.example.com/a.png",
                        ImageFetchPolicy(allowed_domains=("example.com",)))
    assert len(to_private.requests) == 1  # the private host was never contacted
    to_other = Net({"images.example.com": [PUBLIC_IP]}, {"images.example.com/a.png":
                   httpx.Response(301, headers={"location": "https://evil.example.net/"})})
    with pytest.raises(ImageInputError, match="not in this server's"):
        to_other.load("https://images.example.com/a.png", ALLOW)
    ok = Net({"images.example.com": [PUBLIC_IP]}, {
        "images.example.com/old.png": httpx.Response(302, headers={"location": "/new.png"}),
        "images.example.com/new.png": httpx.Response(200, content=raw)})
    assert ok.load("https://images.example.com/old.png", ALLOW) == raw
    loop = Net({"images.example.com": [PUBLIC_IP]}, {
        "images.example.com/a.png": httpx.Response(302, headers={"location": "/a.png"})})
    with pytest.raises(ImageInputError, match="redirected more than"):
        loop.load("https://images.example.com/a.png", ALLOW)


def test_size_status_and_time_caps():
    small = ImageFetchPolicy(allowed_domains=("images.example.com",), max_bytes=2048)
    big = Net({"images.example.com": [PUBLIC_IP]},
              {"images.example.com/big.png": httpx.Response(200, content=b"x" * 5000)})
    with pytest.raises(ImageInputError, match="2048 byte limit"):
        big.load("https://images.example.com/big.png", small)

    async def chunks():
        for _ in range(10):
            yield b"y" * 1000  # no content-length: the reader stops at the cap

    streamed = Net({"images.example.com": [PUBLIC_IP]},
                   {"images.example.com/s.png": httpx.Response(200, content=chunks())})
    with pytest.raises(ImageInputError, match="byte limit"):
        streamed.load("https://images.example.com/s.png", small)
    missing = Net({"images.example.com": [PUBLIC_IP]}, {})
    with pytest.raises(ImageInputError, match="HTTP 404"):
        missing.load("https://images.example.com/none.png", ALLOW)

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(200, content=b"late")

    async def resolve(host: str, port: int) -> list[str]:
        return [PUBLIC_IP]

    quick = ImageFetchPolicy(allowed_domains=("images.example.com",), timeout_s=0.2)
    with pytest.raises(ImageInputError, match="longer than 0.2 s"):
        asyncio.run(load_image_bytes("https://images.example.com/a.png", quick, resolve,
                                     httpx.MockTransport(slow)))


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_decoding_refuses_bombs_truncation_and_unknown_formats():
    from PIL import Image

    assert open_image(png(8, 6)).size == (8, 6)
    with pytest.raises(ImageInputError, match="pixels"):
        open_image(_png_header_only(100_000, 100_000))  # 2 KB claiming 30 GB of pixels
    with pytest.raises(ImageInputError, match="more than the 100 allowed"):
        open_image(png(20, 20), max_pixels=100)
    with pytest.raises(ImageInputError, match="cannot be decoded"):
        open_image(png(64, 64)[:60])
    with pytest.raises(ImageInputError, match="cannot be decoded"):
        open_image(b"GIF89a but not really")
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="TIFF")
    with pytest.raises(ImageInputError, match="format TIFF is not supported"):
        open_image(buf.getvalue())


def test_text_only_model_answers_images_with_400(server):
    url = data_url(png())
    parts = [{"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": url}}]
    chat = {"model": server.engine.model_name,
            "messages": [{"role": "user", "content": parts}]}
    for path, body in (("/v1/chat/completions", chat),
                       ("/generate", {"text": "what is this?", "image_data": url})):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "image_input_not_supported" and "image inputs" in err["message"]
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert models[0]["modalities"] == ["text"]
    ok = httpx.post(server.url + "/generate", json={"text": "still serving"})
    assert ok.status_code == 200

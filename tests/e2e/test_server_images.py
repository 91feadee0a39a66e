"""``image_url`` parts in /v1/chat/completions on a tiny Qwen3-VL: data: URLs, local files
only under --allowed-local-media-path, http(s) refused; every bad image a 400, and the server
keeps serving. Also ``kvroom run --image``."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from server_harness import ThreadServer

from kernel_paths import kernel_path  # noqa: F401 - a fixture
from kvroom.cli import main
from kvroom.engine.params.sampling import SamplingParams
from kvroom.llm import LLM
from kvroom.server.app import create_app
from qwen3_vl_reference import hf_greedy, hf_image_inputs
from tiny_models import QWEN3_VL_MAX_PIXELS, compile_tiny_artifact, write_tiny_qwen3_vl

pytestmark = pytest.mark.server
MODEL = "tiny-vl"


def png_bytes(seed: int = 0) -> bytes:
    pixels = (np.random.default_rng(seed).random((40, 56, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("sources") / "vl")


@pytest.fixture(scope="module")
def artifact(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("artifacts") / "vl"
    return compile_tiny_artifact(source, out, max_image_pixels=QWEN3_VL_MAX_PIXELS)


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png_bytes(1))
    return folder


@pytest.fixture(scope="module")
def server(artifact: Path, media: Path) -> Iterator[tuple[ThreadServer, LLM]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(artifact)
    server = ThreadServer(create_app(llm, served_model_name=MODEL, allowed_local_media_path=media))
    yield server, llm
    server.stop()
    torch.set_num_threads(threads)


def chat(url: str, text: str = "what is this?") -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_data_url_matches_llm_generate(server, artifact: Path) -> None:
    srv, _ = server
    llm = LLM(artifact)  # the server's engine belongs to its loop thread
    resp = srv.post("/v1/chat/completions", json=chat(data_url(png_bytes(1))))
    assert resp.status_code == 200, resp.text
    text = resp.json()["choices"][0]["message"]["content"]
    placeholder = llm.runtime.runner.model.image_placeholder
    ids = llm.apply_chat_template([{"role": "user", "content": placeholder + "what is this?"}])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": png_bytes(1)}}
    assert text == llm.generate(prompt, params)[0].text
    assert resp.json()["usage"]["prompt_tokens"] > len(ids)  # the placeholder was expanded


def test_data_url_gives_transformers_tokens(
    source: Path,
    artifact: Path,
    kernel_path: str,  # noqa: F811 - the imported fixture
) -> None:
    """Served on the kernel path under test, a data: URL request's tokens and their logprobs
    (1e-4) are transformers' greedy ones for the same chat prompt and image."""
    llm = LLM(artifact)  # loaded on the kernel path under test
    server = ThreadServer(create_app(llm, served_model_name=MODEL))
    try:
        body = {**chat(data_url(png_bytes(1))), "logprobs": True}
        resp = server.post("/v1/chat/completions", json=body)
    finally:
        server.stop()
    assert resp.status_code == 200, resp.text
    served = resp.json()["choices"][0]["logprobs"]["content"]
    placeholder = llm.runtime.runner.model.image_placeholder
    ids = llm.apply_chat_template([{"role": "user", "content": placeholder + "what is this?"}])
    image = Image.open(io.BytesIO(png_bytes(1)))
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(source).eval()
    tokens, logprobs = hf_greedy(hf, hf_image_inputs(source, ids, [image], 301, 2), 6)
    assert [c["token"] for c in served] == [llm.tokenizer.decode([t]) for t in tokens]
    assert [c["logprob"] for c in served] == pytest.approx(logprobs, abs=1e-4)


def test_local_file_under_the_allowed_folder(server, media: Path) -> None:
    srv, _ = server
    by_file = srv.post("/v1/chat/completions", json=chat(f"file://{media / 'cat.png'}"))
    by_data = srv.post("/v1/chat/completions", json=chat(data_url(png_bytes(1))))
    assert by_file.status_code == 200, by_file.text
    assert by_file.json()["choices"][0]["message"] == by_data.json()["choices"][0]["message"]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/cat.png", "https URLs are not fetched"),
        ("file:///etc/passwd", "outside --allowed-local-media-path"),
        (data_url(b"garbage"), "not a decodable image"),
        ("data:text/plain;base64,aGk=", "expected data:image/<type>;base64"),
        ("ftp://x/y.png", "unsupported URL scheme 'ftp'"),
    ],
)
def test_bad_image_url_is_a_400_and_the_server_keeps_serving(server, url, message) -> None:
    srv, _ = server
    resp = srv.post("/v1/chat/completions", json=chat(url))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert message in error["message"] and error["param"] == "messages"
    assert srv.post("/v1/chat/completions", json=chat(data_url(png_bytes(2)))).status_code == 200


def test_too_many_images_is_a_400(server) -> None:
    srv, _ = server
    body = chat(data_url(png_bytes(1)))
    body["messages"][0]["content"].insert(0, dict(body["messages"][0]["content"][0]))
    resp = srv.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert "more than max_images_per_request=1" in resp.json()["error"]["message"]


def test_cli_run_with_an_image(artifact: Path, media: Path, capsys) -> None:
    argv = ["run", str(artifact), "--prompt", "what?", "--image", str(media / "cat.png")]
    assert main([*argv, "--max-new-tokens", "3", "--ignore-eos"]) == 0
    assert capsys.readouterr().out.strip()

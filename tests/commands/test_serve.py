"""`kvtier serve` as a process: it starts on loopback; SIGTERM lets in-flight requests finish, or fails them cleanly."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ENGINE_ARGS = ["--block-tokens", "16", "--device-kv-budget", "1MiB", "--swap", "flash", "--swap-space", "4MiB",
               "--io-threads", "2"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def server(request, tiny_model_dir, tmp_path):
    """`kvtier serve` on a free port; an indirect parameter sets --graceful-shutdown (default 600 s)."""
    graceful = getattr(request, "param", 600)  # on a loaded machine a stream may need long; it must not be cut
    flash = tmp_path / "flash.kvc"
    process, url = start_serve(tiny_model_dir, flash, "--no-sparse", *ENGINE_ARGS, "--graceful-shutdown",
                               str(graceful))
    yield process, url, flash
    if process.poll() is None:
        process.kill()
        process.wait()


def start_serve(model_dir, flash, *options: str) -> tuple[subprocess.Popen, str]:
    """`kvtier serve --model model_dir --flash-path flash *options` on a free port, once it answers /health."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--model", str(model_dir), "--port", str(port),
         "--api-key", "k", "--flash-path", str(flash), *options],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ | {"KVTIER_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # importing torch in a fresh process is slow on a loaded machine
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"kvtier serve did not start: {process.communicate()[1][-2000:]}")
        time.sleep(0.2)
    return process, url


def test_sigterm_frees_every_tier_of_a_tiered_request_in_flight(tiny_model_dir, tmp_path):
    """A prompt beyond the 8-block pool is tiered: its cold-pool files under --storage-dir, its scorer process. With
    no grace period SIGTERM fails it at once, and the engine's close releases its tiers: no file is left."""
    storage = tmp_path / "kv"
    storage.mkdir()
    process, url = start_serve(tiny_model_dir, tmp_path / "flash.kvc", "--block-tokens", "16", "--device-kv-budget",
                               "64KiB", "--swap-space", "1MiB", "--host-kv-budget", "4MiB", "--storage-dir",
                               str(storage), "--no-kv-store", "--graceful-shutdown", "0")
    try:
        body = {"model": str(tiny_model_dir), "prompt": " ".join(["the sea light"] * 100), "max_tokens": 4000,
                "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": "Bearer k"},
                          timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):  # a token: the request is decoding as a tiered sequence
                    assert list(storage.iterdir())  # its cold pool's files
                    process.send_signal(signal.SIGTERM)
                    break
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGTERM, stderr[-2000:]
    assert "Traceback" not in stderr
    assert not list(storage.iterdir())  # every tier released: the cold pool's K|V and sketch files, their locks


def test_sigterm_finishes_the_stream_in_flight_and_deletes_the_flash_file(server, tiny_model_dir):
    process, url, flash = server
    body = {"model": str(tiny_model_dir), "prompt": "the sea light", "max_tokens": 40, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": "Bearer k"},
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 1:
                process.send_signal(signal.SIGTERM)
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 40  # the request in flight was finished, not cut
    _, stderr = process.communicate(timeout=120)
    # uvicorn shuts down cleanly, then re-raises the signal it caught, so the exit status reports SIGTERM.
    assert process.returncode == -signal.SIGTERM, stderr[-2000:]
    assert "Application shutdown complete" in stderr and "Traceback" not in stderr
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health")
    assert_flash_file_deleted(flash)


def running(url: str, headers: dict) -> float:
    metrics = text_string_to_metric_families(httpx.get(url + "/metrics", headers=headers).text)
    return next(sample.value for family in metrics for sample in family.samples
                if sample.name == "kvtier:num_requests_running" and sample.labels == {"path": "paged"})


def assert_flash_file_deleted(flash) -> None:
    """Closed at a clean shutdown: the swap file (scratch space) and its lock are gone."""
    assert not flash.exists() and not flash.with_name(flash.name + ".lock").exists()


@pytest.mark.parametrize("server", [0], indirect=True)  # no grace: what is in flight fails at once
def test_sigterm_after_the_grace_period_fails_requests_in_flight_with_an_error_body(server, tiny_model_dir):
    process, url, flash = server
    headers = {"Authorization": "Bearer k"}
    body = {"model": str(tiny_model_dir), "prompt": "the sea light", "max_tokens": 500, "temperature": 0,
            "ignore_eos": True}
    whole: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: whole.append(
        httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)))
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, headers=headers,
                      timeout=120) as response:
        for line in filter(None, response.iter_lines()):
            lines.append(line)
            if len(lines) == 1:
                waiting.start()
                while running(url, headers) < 2:  # the whole-answer request is in flight too
                    time.sleep(0.02)
                process.send_signal(signal.SIGTERM)
    waiting.join()
    # The stream ends with an OpenAI error event and [DONE], well before its 500 tokens.
    assert lines[-1] == "data: [DONE]" and len(lines) < 500
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error == {"message": "the server is shutting down", "type": "server_error", "param": None,
                     "code": "generation_failed"}
    assert whole[0].status_code == 503 and whole[0].json()["error"] == error
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == -signal.SIGTERM, stderr[-2000:]
    assert "Traceback" not in stderr and "Cancel" not in stderr  # failed by the server, not cut by uvicorn
    assert_flash_file_deleted(flash)


def test_a_port_in_use_fails_in_one_line_before_loading_a_model(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # no such model: binding comes first, so its error, not the model's, is the one reported
        result = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--model", str(tmp_path / "no-model"),
                                 "--port", str(port)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr == f"kvtier: error: cannot listen on 127.0.0.1:{port}: Address already in use; stop what " \
                            "serves there or choose another port\n"


def test_port_0_serves_on_a_free_port_and_says_which(tiny_model_dir, tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--model", str(tiny_model_dir), "--port", "0", "--no-sparse",
         "--flash-path", str(tmp_path / "flash.kvc"), *ENGINE_ARGS],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        banner = next(line for line in process.stderr if line.startswith("[serve]"))
        port = int(banner.split("http://127.0.0.1:")[1].split()[0])
        assert port != 0
        deadline = time.monotonic() + 120
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.2)
    finally:
        process.kill()
        process.wait()


def test_bad_options_fail_in_one_line_before_loading_a_model():
    result = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--port", "70000"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip() == "kvtier: error: --port must be 0-65535, got 70000"

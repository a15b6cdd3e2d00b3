"""The OpenAI-compatible server, driven by the official ``openai`` client over loopback.

One server runs in this process (uvicorn in a thread, a tiny model with a chat template); the
graceful-shutdown test starts its own as a subprocess, since SIGTERM must reach a real process.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import uvicorn
from transformers import AutoTokenizer

from specblock.runtime.cli import main as cli_main
from specblock.serve.app import create_app
from specblock.serve.cli import listen, main as serve_main, open_service, parse
from specblock.serve.text import TextStream
from specblock.serve.worker import Job
from tiny import save_tiny

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
FLAGS = ["--dtype", "float32", "--method", "lookup", "--max-new-tokens", "16"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = save_tiny(tmp_path_factory.mktemp("serve") / "m", "llama", vocab=96, ctx=256)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE  # chat requests go through a template, as with a real chat model
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    cfg, opts = parse(["--target", str(model_dir), *FLAGS, "--port", "0"])
    service = open_service(cfg, opts)
    sock = listen("127.0.0.1", 0)
    srv = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    port = sock.getsockname()[1]
    yield SimpleNamespace(port=port, url=f"http://127.0.0.1:{port}", service=service, name=model_dir.name)
    srv.should_exit = True
    thread.join(15)
    sock.close()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def raw(server, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def cli(capsys, model_dir, prompt: str, *extra: str) -> dict:
    code = cli_main(["--target", str(model_dir), *FLAGS, "--prompt", prompt, "--json", "--no-warmup", *extra])
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out.strip().splitlines()[-1])


def metric(server, name: str) -> float:
    _, text = raw(server, "GET", "/metrics")
    for line in text.decode().splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0  # a labelled series appears only once it has counted something


# -- stop strings on decoded text -----------------------------------------------------------------

PIECES = {1: "ab", 2: "c", 3: "EN", 4: "D!", 5: "x", 6: "\ufffd"}


def _decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def test_text_stream_cuts_a_stop_string_that_spans_tokens():
    ts = TextStream(_decode, ["END"])
    assert ts.push([1, 2]) == "abc"
    assert ts.push([3]) == ""  # "EN" may be the start of "END": held back
    assert ts.push([4, 5]) == ""  # it was: the answer ends before it
    assert ts.stopped and ts.text == "abc" and ts.rest() == ""
    assert ts.n_tokens == 4  # up to the token that completed the stop string, not the ones after it


def test_text_stream_releases_held_text_and_partial_characters():
    ts = TextStream(_decode, ["END"])
    assert ts.push([3]) == "" and ts.push([5]) == "ENx"  # not a stop string after all
    assert ts.push([6]) == ""  # a partial UTF-8 character waits for the rest of it
    assert ts.rest() == "\ufffd" and not ts.stopped and ts.n_tokens == 3


# -- the happy paths ------------------------------------------------------------------------------


def test_models_health_and_metrics(server):
    ids = [m.id for m in client(server).models.list().data]
    assert ids == [server.name]
    assert client(server).models.retrieve(server.name).id == server.name
    status, body = raw(server, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    client(server).completions.create(model=server.name, prompt="abc", max_tokens=4)
    status, body = raw(server, "GET", "/metrics")
    text = body.decode()
    assert status == 200
    for name in ("specblock_requests_total", "specblock_prompt_tokens_total", "specblock_completion_tokens_total",
                 "specblock_time_to_first_token_seconds_bucket", "specblock_time_per_output_token_seconds_bucket",
                 "specblock_tau_bucket", "specblock_accepted_length_bucket", "specblock_draft_share_bucket",
                 "specblock_queue_depth", "specblock_adapt_updates_total", "specblock_adapt_rollbacks_total"):
        assert name in text, name
    assert metric(server, 'specblock_requests_total{endpoint="completions",status="200"}') >= 1


def test_chat_greedy_equals_the_cli(server, model_dir, capsys):
    ref = cli(capsys, model_dir, "hello there")  # the CLI sends --prompt through the chat template
    resp = client(server).chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "hello there"}], max_tokens=16, temperature=0)
    assert resp.choices[0].message.content == ref["text"]
    assert resp.usage.completion_tokens == ref["new_tokens"]
    assert resp.choices[0].finish_reason == ("stop" if ref["stopped"] == "eos" else "length")
    spec = resp.to_dict()["speculative"]
    assert spec["method"] == "lookup" and spec["iterations"] >= 1 and spec["tau"] >= 1.0
    assert 0 <= spec["accepted_tokens"] <= resp.usage.completion_tokens


def test_completion_stream_equals_whole_equals_cli(server, model_dir, capsys):
    ref = cli(capsys, model_dir, "abcabcab", "--raw")  # completions continue the text as given
    c = client(server)
    whole = c.completions.create(model=server.name, prompt="abcabcab", max_tokens=16)
    chunks = list(c.completions.create(model=server.name, prompt="abcabcab", max_tokens=16, stream=True,
                                       stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert whole.choices[0].text == streamed == ref["text"]
    assert whole.usage.completion_tokens == ref["new_tokens"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # the include_usage chunk
    assert len({ch.id for ch in chunks}) == 1


def test_chat_stream_equals_whole(server):
    c = client(server)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count: 1 2 3"}]
    whole = c.chat.completions.create(model=server.name, messages=msgs, max_tokens=20)
    chunks = list(c.chat.completions.create(model=server.name, messages=msgs, max_tokens=20, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_strings_cut_the_text_stream_or_not(server):
    c = client(server)
    full = c.completions.create(model=server.name, prompt="abcabcab", max_tokens=16).choices[0].text
    stop = full[5:7]
    cut = full[: full.index(stop)]
    whole = c.completions.create(model=server.name, prompt="abcabcab", max_tokens=16, stop=[stop, "@@@@"])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < 16
    chunks = list(c.completions.create(model=server.name, prompt="abcabcab", max_tokens=16, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == cut


def test_sampling_is_reproducible_with_a_seed(server):
    c = client(server)
    kw = dict(model=server.name, prompt="xyz", max_tokens=12, temperature=1.5, top_p=0.9)
    a = c.completions.create(seed=7, **kw).choices[0].text
    assert c.completions.create(seed=7, **kw).choices[0].text == a
    others = {c.completions.create(seed=s, **kw).choices[0].text for s in range(8, 12)}
    assert others != {a}  # the seed matters (5 draws over a 96-token vocabulary at T=1.5)


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,needle", [
    (dict(n=2), "n = 1"),
    (dict(temperature=5.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(extra_body={"max_tokens": "ten"}), "max_tokens"),
    (dict(extra_body={"tools": [{"type": "function", "function": {"name": "f"}}]}), "tools"),
    (dict(stop=[""]), "stop"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), "role"),
    (dict(messages=[{"role": "user", "content": "x" * 400}]), "context"),
])
def test_bad_chat_requests_are_400(server, kwargs, needle):
    body = dict(model=server.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(**body)
    assert e.value.status_code == 400 and needle in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"  # OpenAI's error object


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as e:
        client(server).completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"model": "m"}', b"\xff\xfe",
                                  b'{"model": "m", "prompt": "x", "temperature": NaN}'])
def test_malformed_bodies_are_400_with_an_error_object(server, body):
    status, out = raw(server, "POST", "/v1/completions", body)
    assert status == 400 and set(json.loads(out)["error"]) >= {"message", "type", "param", "code"}


def test_prompt_over_context_and_bad_token_ids_are_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model=server.name, prompt="y" * 300, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model=server.name, prompt=[5, 500], max_tokens=2)
    ok = client(server).completions.create(model=server.name, prompt=[5, 6, 7], max_tokens=3)
    assert ok.usage.prompt_tokens == 3


# -- the queue ------------------------------------------------------------------------------------


def _hold_engine(service) -> tuple[threading.Event, threading.Event]:
    """Queue a job whose first token blocks the worker until released: the engine is busy."""
    busy, release = threading.Event(), threading.Event()

    def sink(ev) -> None:
        busy.set()
        release.wait(30)

    service.worker.submit(Job(ids=[5, 6, 7], max_tokens=2, temperature=0.0, top_p=1.0, seed=0, stops=[],
                              stream=True, sink=sink))
    assert busy.wait(30)
    return busy, release


def test_full_queue_answers_503_and_the_queued_request_still_completes(server):
    worker = server.service.worker
    old, worker.max_queue = worker.max_queue, 1
    _, release = _hold_engine(server.service)
    try:
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(client(server).completions.create, model=server.name, prompt="abc", max_tokens=4)
            deadline = time.monotonic() + 10
            while worker.waiting < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(openai.InternalServerError) as e:
                client(server).completions.create(model=server.name, prompt="abc", max_tokens=4)
            assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
            release.set()
            assert queued.result(30).usage.completion_tokens == 4
    finally:
        release.set()
        worker.max_queue = old


def test_client_disconnect_cancels_generation_and_frees_the_engine(server, monkeypatch):
    worker = server.service.worker
    slow, decoded = worker._decode, []

    def decode(ids):  # ~0.2 s per iteration: 128 tokens would take over 3 s
        decoded.append(len(ids))
        time.sleep(0.2)
        return slow(ids)

    monkeypatch.setattr(worker, "_decode", decode)
    gone = 'specblock_requests_total{endpoint="completions",status="499"}'
    before = metric(server, gone)
    stream = client(server).completions.create(model=server.name, prompt="q", max_tokens=128, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while metric(server, gone) == before or metric(server, "specblock_running") > 0:
        assert time.monotonic() < deadline, "the disconnect was never noticed"
        time.sleep(0.05)
    monkeypatch.setattr(worker, "_decode", slow)
    assert max(decoded) < 128  # generation stopped early, not run to max_tokens for nobody
    assert client(server).completions.create(model=server.name, prompt="abc", max_tokens=4).usage.completion_tokens == 4


def test_32_concurrent_clients_get_their_own_answers(server):
    prompts = [f"{i}:" + "abcdefgh"[i % 8:] + "xyz"[: i % 3] for i in range(32)]
    c = client(server)

    def ask(i: int) -> tuple[str, str]:
        if i % 2:
            chunks = list(c.completions.create(model=server.name, prompt=prompts[i], max_tokens=12, stream=True))
            return chunks[0].id, "".join(ch.choices[0].text for ch in chunks)
        r = c.completions.create(model=server.name, prompt=prompts[i], max_tokens=12)
        return r.id, r.choices[0].text

    alone = [ask(i)[1] for i in range(32)]  # one at a time: the reference
    assert len(set(alone)) > 8  # distinct prompts give distinct answers, so a mix-up would show
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, range(32)))
    assert [t for _, t in together] == alone
    assert len({i for i, _ in together}) == 32


# -- the command ----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,needle", [
    (["--prompt", "hi"], "--prompt is for the CLI"),
    (["--max-queue", "0"], "--max-queue"),
    (["--port", "70000"], "--port"),
    (["--temperature", "-1"], "--temperature"),
])
def test_bad_flags_exit_2_with_one_line(argv, needle, capsys):
    assert serve_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


@contextmanager
def server_process(model_dir):
    """``python -m specblock.serve`` on the test model in a process of its own (SIGTERM must reach a
    real process); killed at the end if it is still running."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "specblock.serve", "--target", str(model_dir), *FLAGS,
                             "--port", "0", "--no-warmup"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_finishes_in_flight_requests_and_exits_0(model_dir):
    with server_process(model_dir) as proc:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
        url = line.split("listening on ")[1].split()[0]
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        stream = c.completions.create(model=model_dir.name, prompt="abc", max_tokens=64, stream=True)
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)  # the in-flight request is finished, not cut
        assert (rest[-1] if rest else first).choices[0].finish_reason in ("length", "stop")
        assert proc.wait(30) == 0


def test_sigterm_right_after_the_listening_line_stops_the_server(model_dir):
    """Before uvicorn installs its handler a SIGTERM was swallowed, and the server ran on."""
    with server_process(model_dir) as proc:
        assert "listening on" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_load_test_counts_errors_and_mixed_up_answers():
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "experiments" / "serve_load.py")
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)
    ref: dict[str, str] = {}
    one = [{"id": "a", "text": "x", "tokens": 4, "ttft": 0.1, "tpot": 0.01, "tau": 2.0},
           {"id": "b", "text": "y", "tokens": 4, "ttft": 0.3, "tpot": 0.03, "tau": 1.0}]
    row = load.summarize(1, one, 2.0, ref)
    assert row["mismatched"] == 0 and row["errors"] == 0 and row["throughput_tok_s"] == 4.0
    assert row["ttft_s_p50"] == 0.2 and row["tpot_ms_p50"] == 20.0 and row["tau"] == 1.5
    swapped = [{**one[0], "text": "y"}, {**one[1], "text": "x"}, {"id": "a", "error": "APIConnectionError: x"}]
    row = load.summarize(4, swapped, 1.0, ref)  # answers handed to the wrong requests, one lost
    assert row["mismatched"] == 2 and row["errors"] == 1 and "APIConnectionError" in row["first_error"]

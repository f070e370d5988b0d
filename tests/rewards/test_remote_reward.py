"""The remote HTTP JSON reward against a local server on 127.0.0.1: batching, retries, timeouts, bad replies."""

import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlhf.data.records import PromptRecord
from rlhf.errors import ConfigError, RewardError
from rlhf.rewards.registry import RemoteReward, RewardConfig, build_reward
from rlhf.rewards.config import RemoteRewardConfig


class RewardService:
    """A scripted service: each request pops the next behaviour ("ok" scores len(response))."""

    def __init__(self):
        self.requests, self.script, self.release = [], [], threading.Event()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append(body["samples"])
                behaviour = service.script.pop(0) if service.script else "ok"
                if behaviour == "hang":
                    service.release.wait(timeout=30)
                    return
                status, reply = service.reply(behaviour, body["samples"])
                self.send_response(status)
                self.end_headers()
                self.wfile.write(reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @staticmethod
    def reply(behaviour, samples):
        scores = [float(len(s["response"])) for s in samples]
        if behaviour == "ok":
            return 200, json.dumps({"scores": scores}).encode()
        if behaviour == "nan":
            return 200, json.dumps({"scores": [math.nan] + scores[1:]}).encode()
        if behaviour == "short":
            return 200, json.dumps({"scores": scores[1:]}).encode()
        if behaviour == "garbage":
            return 200, b"<html>oops</html>"
        return int(behaviour), b'{"error": "bad\\nrequest"}'

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture()
def service():
    running = RewardService()
    yield running
    running.close()


def records(n):
    return [PromptRecord(prompt=[{"role": "user", "content": f"q{i}"}], data_source="svc", ground_truth=str(i),
                         extra_info={"k": i}, index=100 + i) for i in range(n)]


def remote(service, **kwargs):
    return RemoteReward(RemoteRewardConfig(**({"url": service.url, "retry_backoff_s": 0.0} | kwargs)))


def test_batches_keep_order_and_carry_every_field(service):
    responses = ["x" * i for i in range(10)]
    rewards_b = remote(service, batch_size=4, max_in_flight=2).score(records(10), responses)
    assert rewards_b.dtype == torch.float32 and rewards_b.tolist() == [float(i) for i in range(10)]
    sent = sorted((s for batch in service.requests for s in batch), key=lambda s: s["index"])
    assert sorted(len(batch) for batch in service.requests) == [2, 4, 4]
    assert [s["index"] for s in sent] == list(range(100, 110))  # every sample sent exactly once
    assert sent[3] == {"index": 103, "data_source": "svc", "prompt": [{"role": "user", "content": "q3"}],
                       "response": "xxx", "ground_truth": "3", "extra_info": {"k": 3}}


def test_transient_errors_are_retried(service):
    service.script = ["503", "429", "ok"]
    assert remote(service, max_retries=2).score(records(2), ["a", "bb"]).tolist() == [1.0, 2.0]
    assert len(service.requests) == 3


def test_retries_run_out(service):
    service.script = ["503", "503"]
    with pytest.raises(RewardError) as info:
        remote(service, max_retries=1).score(records(2), ["a", "b"])
    assert str(info.value) == (f"reward service {service.url} for samples 0-1 failed after 2 attempts: "
                               'HTTP 503 {"error": "bad\\nrequest"}')


def test_timeout(service):
    service.script = ["hang"]
    with pytest.raises(RewardError, match=r"for samples 0-0 failed after 1 attempts: no full reply within "
                                          r"reward\.remote\.timeout_s=0\.2s$"):
        remote(service, max_retries=0, timeout_s=0.2).score(records(1), ["a"])


class RawReplyServer:
    """Answers one request with `head` then `body`, `chunk` bytes every `pause_s`; stops by itself after the body
    or when the client hangs up (a bounded loop: nothing outlives the test)."""

    def __init__(self, head: bytes, body: bytes, chunk: int, pause_s: float):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/score"
        self.head, self.body, self.chunk, self.pause_s = head, body, chunk, pause_s
        self.sent = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(self.head)
                for start in range(0, len(self.body), self.chunk):
                    conn.sendall(self.body[start:start + self.chunk])
                    self.sent += self.chunk
                    time.sleep(self.pause_s)
            except OSError:
                pass  # the client cut the connection: done

    def close(self):
        self.thread.join()
        self.listener.close()


def test_a_trickling_server_misses_the_whole_request_deadline():
    """1 byte per 0.05 s never trips a per-read timeout of 0.5 s, but the request as a whole must end at 0.5 s."""
    body = json.dumps({"scores": [1.0]}).encode() + b" " * 400
    server = RawReplyServer(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body), body, 1, 0.05)
    try:
        reward = RemoteReward(RemoteRewardConfig(url=server.url, max_retries=0, timeout_s=0.5))
        with pytest.raises(RewardError) as info:
            reward.score(records(1), ["a"])
    finally:
        server.close()
    assert str(info.value) == (f"reward service {server.url} for samples 0-0 failed after 1 attempts: "
                               "no full reply within reward.remote.timeout_s=0.5s")
    assert server.sent < len(body)


def test_an_oversized_reply_is_refused():
    body = b'{"scores": [' + b"1.0, " * 20_000 + b"1.0]}"
    server = RawReplyServer(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", body, 4096, 0.0)
    try:
        reward = RemoteReward(RemoteRewardConfig(url=server.url, max_retries=3, max_reply_bytes=10_000))
        with pytest.raises(RewardError) as info:
            reward.score(records(1), ["a"])
    finally:
        server.close()
    assert str(info.value) == (f"reward service {server.url} for samples 0-0 replied with more than "
                               "reward.remote.max_reply_bytes=10000 bytes; raise the cap or lower "
                               "reward.remote.batch_size")


def test_client_error_is_not_retried(service):
    service.script = ["400"]
    with pytest.raises(RewardError, match=r'for samples 0-1 answered HTTP 400: \{"error": "bad\\nrequest"\}'):
        remote(service, max_retries=3).score(records(2), ["a", "b"])
    assert len(service.requests) == 1


@pytest.mark.parametrize("behaviour, message", [
    ("nan", r"reward for sample 4 \(index 104, data_source 'svc'\) from .* is nan, not a finite number"),
    ("short", r"for samples 4-5 replied without a 'scores' list of 2 numbers"),
    ("garbage", r"for samples 4-5 replied with non-JSON: b'<html>oops</html>'"),
])
def test_bad_replies_name_the_samples(service, behaviour, message):
    service.script = ["ok", "ok", behaviour]
    with pytest.raises(RewardError, match=message):
        remote(service, batch_size=2, max_in_flight=1).score(records(6), ["a"] * 6)


class RewardServiceClosed:
    """A 127.0.0.1 URL whose port was just freed, so connecting is refused."""

    def __enter__(self):
        server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
        port = server.server_port
        server.server_close()
        return f"http://127.0.0.1:{port}/"

    def __exit__(self, *exc):
        return False


def test_unreachable_service():
    with RewardServiceClosed() as url:
        reward = RemoteReward(RemoteRewardConfig(url=url, max_retries=1, retry_backoff_s=0.0))
        with pytest.raises(RewardError, match="failed after 2 attempts: ConnectionRefusedError: .*[Cc]onnection refused"):
            reward.score(records(1), ["a"])


def test_config_validation_and_factory(service):
    with pytest.raises(ConfigError, match="reward.remote.url='localhost:1' must start with http"):
        RemoteRewardConfig(url="localhost:1")
    with pytest.raises(ConfigError, match="reward.remote.batch_size=0 must be >= 1"):
        RemoteRewardConfig(url=service.url, batch_size=0)
    with pytest.raises(ConfigError, match="reward.remote.max_reply_bytes=0 must be >= 1"):
        RemoteRewardConfig(url=service.url, max_reply_bytes=0)
    with pytest.raises(ConfigError, match="reward.remote scores every sample"):
        RewardConfig(function="x.py:f", remote=RemoteRewardConfig(url=service.url))
    reward = build_reward(RewardConfig(remote=RemoteRewardConfig(url=service.url)))
    assert isinstance(reward, RemoteReward) and reward.score(records(1), ["abc"]).tolist() == [3.0]

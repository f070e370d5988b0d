"""One HTTP(S) POST under one overall deadline, the only way rlhf calls out (alert webhook, remote reward).

A socket timeout restarts on every byte, so a server that trickles its reply could hold a call forever. Here a
timer shuts the socket down at the deadline, whatever phase the call is in (connect, send, reading the reply),
and `cut()` ends it early from another thread (a shutdown that must not wait).
"""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.parse
from dataclasses import dataclass


class DeadlineExceeded(Exception):
    """The call did not complete within its deadline (or was cut)."""


class ReplyTooLarge(Exception):
    """The reply grew past the caller's byte cap."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes


class DeadlinePost:
    """POST `body` (JSON) to `url` once: `send()` returns the reply or raises DeadlineExceeded, ReplyTooLarge,
    OSError, http.client.HTTPException or ValueError (a malformed URL), all within `timeout_s`."""

    def __init__(self, url: str, body: bytes, *, timeout_s: float, max_reply_bytes: int) -> None:
        self.url, self.body, self.timeout_s, self.max_reply_bytes = url, body, timeout_s, max_reply_bytes
        self._connection: http.client.HTTPConnection | None = None
        self._expired = threading.Event()

    def cut(self) -> None:
        """End the call now (from any thread): a blocked connect/send/read returns and `send()` raises."""
        self._expired.set()
        sock = self._connection.sock if self._connection is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def send(self) -> Reply:
        timer = threading.Timer(self.timeout_s, self.cut)
        timer.daemon = True
        timer.start()
        parts = urllib.parse.urlsplit(self.url)
        connection_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        try:
            connection = self._connection = connection_type(parts.hostname, parts.port, timeout=self.timeout_s)
            connection.connect()
            self._check()  # the deadline passed while connecting: the timer found no socket to shut
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            connection.request("POST", target, body=self.body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            body = self._read_capped(response)
            self._check()
            return Reply(response.status, body)
        except (OSError, http.client.HTTPException) as error:
            # the socket's own per-operation timeout (also timeout_s) may fire before the timer on a busy host
            if isinstance(error, TimeoutError):
                self._expired.set()
            self._check()
            raise
        finally:
            timer.cancel()
            if self._connection is not None:
                self._connection.close()

    def _check(self) -> None:
        if self._expired.is_set():
            raise DeadlineExceeded(f"no full reply within {self.timeout_s:g}s")

    def _read_capped(self, response: http.client.HTTPResponse) -> bytes:
        chunks, size = [], 0
        while chunk := response.read1(65536):
            size += len(chunk)
            if size > self.max_reply_bytes:
                raise ReplyTooLarge(f"more than {self.max_reply_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

"""A misbehaving client: malformed requests and dropped connections against a server's host:port, `n` of each kind.

    python hostile_client.py HOST PORT N

Malformed: bytes that are not HTTP (a TLS hello), a request line without a path, a body that is not JSON, a body of
the wrong types, a negative Content-Length, a 70 KB header. Dropped: a full completion request whose connection is
reset before the answer (what a killed client does), a request cut off in its headers (slowloris), a body cut short.
Each connection is closed (or reset) by the client; nothing waits on the server beyond a short read."""
from __future__ import annotations

import json
import socket
import struct
import sys
import time

_BODY = json.dumps({"prompt": [[1, 2, 3]] * 4, "max_tokens": 8, "temperature": 0}).encode()
_TYPES = b'{"prompt": [[1, 2]], "n": "x", "max_tokens": [], "a": 1}'


def _post(body: bytes, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % size) + body


MALFORMED = {
    "not_http": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n",
    "no_path": b"GET\r\n\r\n",
    "bad_json": _post(b"{nope"),
    "bad_types": _post(_TYPES),
    "negative_length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -3\r\n\r\n{}",
    "huge_header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 70000 + b"\r\n\r\n",
}
DROPPED = {
    "reset_before_answer": _post(_BODY),
    "slowloris": b"GET /health HTTP/1.1\r\nHost: x\r\n",
    "body_cut_short": _post(b'{"pro', length=100),
}


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a killed client's kernel does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def attack(host: str, port: int, n: int) -> dict[str, int]:
    """Every kind `n` times; how many of each the server accepted a connection for."""
    done: dict[str, int] = {}
    for kind, data in {**MALFORMED, **DROPPED}.items():
        done[kind] = 0
        for _ in range(n):
            try:
                sock = socket.create_connection((host, port), timeout=5)
                sock.sendall(data)
            except OSError:
                continue
            done[kind] += 1
            if kind in MALFORMED:
                try:
                    sock.recv(4096)
                except OSError:
                    pass
                sock.close()
            else:
                time.sleep(0.02)
                _reset(sock)
    return done


if __name__ == "__main__":
    print(json.dumps(attack(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))

"""A server whose health check answers late: `GET /health` waits DELAY seconds, then 200. argv: HOST PORT DELAY.
Stands for an engine that is busy but alive (each answer well within a health probe's time)."""
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

host, port, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        time.sleep(delay)
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


print(f"slow_health: serving on {host}:{port}, health after {delay:g} s", flush=True)
ThreadingHTTPServer((host, port), Handler).serve_forever()

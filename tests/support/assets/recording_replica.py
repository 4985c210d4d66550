"""A replica that records what it is sent: the weight-transfer side of TRL's protocol, checked without NCCL.

    python recording_replica.py PORT WORLD_SIZE RECORD_DIR NAME

Every request is appended to RECORD_DIR/NAME.jsonl as {"method", "path", "body"}. /init_weight_transfer_engine and
/update_weights block, as vLLM's workers do in the NCCL rendezvous, until every replica has received the same call
(a marker file per replica in RECORD_DIR; $REPLICAS of them): a router that forwarded them one after the other
would leave the first one waiting, and it answers 504.
/health answers 503 while RECORD_DIR/NAME.sick exists.
POST /v1/completions answers each prompt with itself as the text, after sleeping the body's `delay_s` when the
body's `slow_on` is unset or NAME (a slow generation on one replica; recorded on arrival, so a test sees a request is
on this replica before killing or stopping it); it answers 500 instead when the body's `fail_on` is NAME or "all".
"""
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, world, record_dir, name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]


def record(method, path, body):
    with open(os.path.join(record_dir, f"{name}.jsonl"), "a") as f:
        f.write(json.dumps({"method": method, "path": path, "body": body}) + "\n")


def rendezvous(call, expected, timeout=10.0):
    """Block until `expected` replicas have a marker for `call` (the n-th time it is made)."""
    key = call.strip("/").replace("/", "_")
    count = sum(1 for f in os.listdir(record_dir) if f.startswith(f"{key}.{name}.")) + 1
    open(os.path.join(record_dir, f"{key}.{name}.{count}"), "w").close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        joined = [f for f in os.listdir(record_dir) if f.startswith(f"{key}.") and f.endswith(f".{count}")]
        if len(joined) >= expected:
            return True
        time.sleep(0.02)
    return False


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def send(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?")[0]
        record("GET", self.path, None)
        if path == "/health":
            sick = os.path.exists(os.path.join(record_dir, f"{name}.sick"))
            self.send(503 if sick else 200, {})
        elif path == "/get_world_size":
            self.send(200, {"world_size": world})
        elif path == "/server_info":
            self.send(200, {"vllm_config": {"weight_transfer_config": {"backend": "nccl"}, "name": name}})
        elif path == "/v1/models":
            self.send(200, {"data": [{"id": "recorded"}]})
        else:
            self.send(404, {})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"null")
        record("POST", self.path, body)
        if self.path == "/init_weight_transfer_engine":
            ok = rendezvous(self.path, int(os.environ["REPLICAS"]))
            self.send(200 if ok else 504, {"joined": ok, "rank_offset": body["init_info"]["rank_offset"]})
        elif self.path == "/update_weights":
            ok = rendezvous(self.path, int(os.environ["REPLICAS"]))
            self.send(200 if ok else 504, {"joined": ok})
        elif self.path == "/v1/completions":
            if body.get("fail_on") in (name, "all"):
                self.send(500, {"error": {"message": f"{name} failed on purpose"}})
                return
            if body.get("slow_on") in (None, name):
                time.sleep(float(body.get("delay_s") or 0))
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            self.send(200, {"replica": name, "choices": [{"index": i, "text": p} for i, p in enumerate(prompts)]})
        elif self.path.split("?")[0] in ("/start_weight_update", "/finish_weight_update", "/reset_prefix_cache",
                                         "/pause", "/resume", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                                         "/shutdown_weight_transfer_engine"):
            self.send(200, {"name": name})
        else:
            self.send(404, {})


ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()

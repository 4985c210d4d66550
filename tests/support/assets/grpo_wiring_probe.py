"""Builds GRPOConfig three ways (defaults, explicit kwargs, TrlParser over a command line given as JSON) and records the
vLLM fields each ended with, plus whether the rollout server answers at the address it was given. No vLLM needed."""
import json
import os
import sys
import urllib.request

from trl import GRPOConfig, TrlParser

out = sys.argv[1]
common = dict(output_dir=os.path.join(out, "o"), report_to="none", use_cpu=True)
default = GRPOConfig(**common)
explicit = GRPOConfig(**common, vllm_server_port=9000, use_vllm=False)
# as if the script had been started with these flags (the first two configs saw a command line without them)
sys.argv = [sys.argv[0]] + json.loads(sys.argv[2])
(parsed,) = TrlParser((GRPOConfig,)).parse_args_into_dataclasses(sys.argv[1:])
fields = ("use_vllm", "vllm_mode", "vllm_server_host", "vllm_server_port", "vllm_group_port")
record = {name: {k: getattr(c, k) for k in fields} for name, c in
          (("default", default), ("explicit", explicit), ("parsed", parsed))}
url = f"http://{default.vllm_server_host}:{default.vllm_server_port}/health"
with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=10) as r:
    record["health"] = r.status
record["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
record["vllm_host_ip"] = os.environ.get("VLLM_HOST_IP")   # the weight-sync address vLLM's get_ip() gives
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(record, f)

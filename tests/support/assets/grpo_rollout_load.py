"""An unchanged-style GRPO setup against a separate rollout it never names, with several engine replicas behind one
address: builds GRPOConfig (dualrun fills its server fields), then TRL's own `VLLMClient` from those fields as
GRPOTrainer does in server mode, and sends the load GRPOTrainer sends (every prompt's token ids, `num_generations`
completions each, in one request, which the router splits over the replicas), then single-prompt requests at once
from threads (as TRL's client sends chat and image requests). Greedy, so the router's answers can be compared with
one replica's own answers to the same requests.

Records (out/rank0.json): the filled fields, the world size the client sees, both answers, and what each replica
served (its `/engine/stats` before and after the router's traffic). GRPOTrainer itself is not built: without vLLM
it refuses server mode (with vLLM's CPU build and `engine: vllm` it trains: test_vllm_rollout.py).

    grpo_rollout_load.py MODEL PROMPTS.jsonl OUT [--then-wait]   # --then-wait: write OUT/generated, then sleep
"""
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests
from transformers import AutoTokenizer
from trl import GRPOConfig
from trl.generation import vllm_client

from dualrun.programs.cpu_engine import STATS_PATH as ENGINE_STATS
from dualrun.programs.routing import STATS_PATH as ROUTER_STATS

model, data, out = sys.argv[1:4]
config = GRPOConfig(output_dir=os.path.join(out, "grpo"), per_device_train_batch_size=2, num_generations=2,
                    max_completion_length=6, report_to="none", use_cpu=True, bf16=False)
rec = {"grpo": {k: getattr(config, k) for k in ("use_vllm", "vllm_mode", "vllm_server_base_url", "vllm_server_host",
                                                "vllm_server_port", "vllm_group_port")}}
if not vllm_client.is_vllm_available():  # the client's HTTP side needs no vLLM; only its weight sync does
    vllm_client.is_vllm_available = lambda *a, **k: True


def client_for(base_url: str) -> vllm_client.VLLMClient:
    """As GRPOTrainer builds it (trl/generation/vllm_generation.py, server mode)."""
    return vllm_client.VLLMClient(base_url=base_url, group_port=config.vllm_group_port,
                                  connection_timeout=config.vllm_server_timeout)


def get(url: str) -> dict:
    return requests.get(url, timeout=30, proxies={"http": None}).json()


base = config.vllm_server_base_url or f"http://{config.vllm_server_host}:{config.vllm_server_port}"
client = client_for(base)
rec["world_size"] = client.get_world_size()
replicas = [r["address"] for r in get(f"{base}{ROUTER_STATS}")["replicas"]]
rec["replicas"] = replicas

tok = AutoTokenizer.from_pretrained(model)
with open(data) as f:   # GRPO's conversational prompts, tokenized with the chat template as GRPOTrainer does
    rows = [json.loads(line) for line, _ in zip(f, range(8))]
ids = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
       for r in rows]
greedy = dict(n=config.num_generations, max_tokens=config.max_completion_length, temperature=0.0, logprobs=0)

one = client_for(f"http://{replicas[0]}")  # one engine's answers first: what the replicas serve next is the router's
want = one.generate(ids, **greedy)
want_single = [one.generate([p], **{**greedy, "n": 1})["completion_ids"][0] for p in ids[:4]]
time.sleep(0.2)
before = [get(f"http://{r}{ENGINE_STATS}") for r in replicas]

got = client.generate(ids, **greedy)  # GRPOTrainer's one request: 8 prompts x 2 completions, split by the router
with ThreadPoolExecutor(4) as pool:   # four single-prompt requests at once
    single = list(pool.map(lambda p: client.generate([p], **{**greedy, "n": 1})["completion_ids"][0], ids[:4]))
after = [get(f"http://{r}{ENGINE_STATS}") for r in replicas]

rec.update(want=want, got=got, want_single=want_single, single=single,
           served=[a["completions"] - b["completions"] for a, b in zip(after, before)],
           prompts=[a["prompts"] - b["prompts"] for a, b in zip(after, before)])
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(rec, f)
if "--then-wait" in sys.argv:  # the test kills a replica now: the launcher must end the job
    open(os.path.join(out, "generated"), "w").close()
    time.sleep(120)

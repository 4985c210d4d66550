"""What the router does with each request of TRL's server protocol: pure logic, no sockets (`router.py` serves it).

Why a table: TRL 1.16's clients (GRPOTrainer's `VLLMClient`, AsyncGRPOTrainer's in `trl.experimental.async_grpo`)
speak a fixed set of endpoints, and each needs one of a few treatments when several engine replicas stand behind
one address — health and world size are aggregated, generation is spread (a request carrying many prompts is split
and its answers put back in order), and the weight-transfer calls are fanned out to every replica, each with its
own rank offset in the trainer's one weight-sync group (NCCL on GPUs, gloo on CPU; the layout verl and OpenRLHF
use), as are the calls that must reach every engine (pause/resume around an update, a LoRA adapter to load).
Anything not in the table is refused with a line that says so.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any, Sequence

# treatments
HEALTH = "health"            # 200 only when every replica answers 200
WORLD_SIZE = "world_size"    # the weight-transfer members' world sizes summed
FIRST = "first"              # every replica serves the same model and config: the first one answers
SPLIT = "split"              # many prompts: cut into one chunk per replica, answers reassembled in order
ONE = "one"                  # one replica (the least busy) takes the whole request
INIT_WEIGHTS = "init"        # to the members the world size counted (rotation.forming), each with its own rank offset
GROUP = "group"              # to the weight-sync group's members at once (rotation.in_group: they block together in
                             # its collectives); all must succeed
ALL = "all"                  # to every member at once (rotation.members); all must succeed

UPDATE_WEIGHTS_PATH = "/update_weights"          # answered 200: the replica received an update
FINISH_UPDATE_PATH = "/finish_weight_update"     # answered 200: it completed it (a held replica is restored)

ROUTES: dict[tuple[str, str], str] = {
    ("GET", "/health"): HEALTH,
    ("GET", "/server_info"): FIRST,
    ("GET", "/get_world_size"): WORLD_SIZE,
    ("GET", "/v1/models"): FIRST,
    ("POST", "/v1/completions"): SPLIT,
    ("POST", "/v1/chat/completions"): ONE,
    ("POST", "/v1/chat/completions/render"): ONE,
    ("POST", "/inference/v1/generate"): ONE,
    ("POST", "/init_weight_transfer_engine"): INIT_WEIGHTS,
    ("POST", "/start_weight_update"): GROUP,
    ("POST", UPDATE_WEIGHTS_PATH): GROUP,
    ("POST", FINISH_UPDATE_PATH): GROUP,
    ("POST", "/reset_prefix_cache"): ALL,
    ("POST", "/close_communicator"): GROUP,
    ("POST", "/shutdown_weight_transfer_engine"): GROUP,   # vLLM's: leave the group (before it is re-formed)
    # AsyncGRPOTrainer's client: generation paused on every engine while its weights change; an adapter on each
    ("POST", "/pause"): ALL,
    ("POST", "/resume"): ALL,
    ("POST", "/v1/load_lora_adapter"): ALL,
    ("POST", "/v1/unload_lora_adapter"): ALL,
}
STATS_PATH = "/router/stats"  # the router's own: each replica's counters and whether it is in rotation
# The launcher's say over the rotation (see rotation.py): POST /router/replicas/<index>/<action>, with a JSON body
# {"address": "host:port", "hold": bool} for `replace`, {"reason": str} for `remove` and `retire`, nothing for
# `restore`.
CONTROL_PATH = "/router/replicas"
CONTROL_ACTIONS = ("replace", "restore", "remove", "retire")


@functools.lru_cache(maxsize=256)   # asked several times a request (the guard, the handler, the counters)
def route(method: str, path: str) -> str | None:
    """The treatment of `method path` (query string and trailing slash ignored), None when it is not served."""
    return ROUTES.get((method.upper(), path.split("?")[0].rstrip("/") or "/"))


def control(method: str, path: str) -> tuple[int, str] | None:
    """(replica index, action) of a control request (`POST /router/replicas/1/restore`), None when it is not one.
    ValueError for a control path with an unknown action or a bad index."""
    prefix = CONTROL_PATH + "/"
    if method.upper() != "POST" or not path.startswith(prefix):
        return None
    index, _, action = path[len(prefix):].rstrip("/").partition("/")
    if not index.isdigit() or action not in CONTROL_ACTIONS:
        raise ValueError(f"expected POST {CONTROL_PATH}/<index>/<{'|'.join(CONTROL_ACTIONS)}>, got POST {path}")
    return int(index), action


def step_of(header: str | None) -> int | None:
    """The trainer's global step a request's `protocol.STEP_HEADER` says (None: none, or not a step)."""
    value = (header or "").strip()
    return int(value) if value.isascii() and value.isdigit() else None


def unknown_endpoint(method: str, path: str) -> str:
    served = ", ".join(f"{m} {p}" for m, p in ROUTES)
    return f"the dualrun router does not forward {method} {path.split('?')[0]}; it serves {served}"


def prompts_of(body: dict) -> list[Any] | None:
    """The prompts of a /v1/completions body as a list, or None when it carries a single prompt (one string or one
    list of token ids), which goes to one replica whole."""
    raw = body.get("prompt")
    if isinstance(raw, str) or not isinstance(raw, list) or not raw:
        return None
    if all(map(isinstance, raw, itertools.repeat(int))):   # (a generator's step per token costs more)
        return None
    return raw


def chunks(count: int, replicas: int) -> list[tuple[int, int]]:
    """(start, stop) of `count` prompts cut into at most `replicas` contiguous, nearly equal parts."""
    parts = max(1, min(count, replicas))
    size, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + size + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def split_completion(body: dict, prompts: Sequence[Any], replicas: int) -> list[tuple[int, dict]]:
    """One /v1/completions body per chunk: (first prompt's index, body with only that chunk's prompts)."""
    return [(start, {**body, "prompt": list(prompts[start:stop])}) for start, stop in chunks(len(prompts), replicas)]


def merge_completions(parts: Sequence[tuple[int, dict]], n: int) -> dict:
    """The answers of the chunks as one answer: choices prompt-major in the original order (`index` renumbered),
    usage summed, the rest from the first chunk."""
    merged = dict(parts[0][1])
    choices = []
    for start, answer in parts:
        for choice in answer.get("choices", []):
            choice = dict(choice)
            if isinstance(choice.get("index"), int):
                choice["index"] += start * n
            choices.append(choice)
    merged["choices"] = choices
    usages = [answer.get("usage") for _, answer in parts if isinstance(answer.get("usage"), dict)]
    if usages:
        keys = {k for u in usages for k, v in u.items() if isinstance(v, int)}
        merged["usage"] = {**usages[0], **{k: sum(int(u.get(k) or 0) for u in usages) for k in keys}}
    return merged


def rank_offsets(world_sizes: Sequence[int], first: int) -> list[int]:
    """Each replica's first rank in the trainer's group: the client's offset (its own ranks come first), then the
    replicas one after the other."""
    return [first + before for before in itertools.accumulate([0, *world_sizes[:-1]])]


def init_bodies(body: dict, world_sizes: Sequence[int]) -> list[dict]:
    """/init_weight_transfer_engine per replica: the client's `init_info` with that replica's `rank_offset`.
    ValueError when the group the client announces is not its own ranks and every replica's workers."""
    info = body.get("init_info")
    if not isinstance(info, dict) or not isinstance(info.get("rank_offset"), int):
        raise ValueError("/init_weight_transfer_engine needs {'init_info': {'rank_offset': int, 'world_size': int, "
                         "...}}")
    total = sum(world_sizes)
    wanted = info["rank_offset"] + total
    if isinstance(info.get("world_size"), int) and info["world_size"] != wanted:
        # (larger, the group would wait for ranks no engine holds: refused now, not after the trainer's bound)
        how = "cannot hold" if info["world_size"] < wanted else "is more than"
        raise ValueError(f"init_info.world_size {info['world_size']} {how} rank_offset {info['rank_offset']} plus "
                         f"the {total} workers of the replicas behind this router ({list(world_sizes)}), those its "
                         "/get_world_size counted")
    return [{**body, "init_info": {**info, "rank_offset": offset}}
            for offset in rank_offsets(world_sizes, info["rank_offset"])]

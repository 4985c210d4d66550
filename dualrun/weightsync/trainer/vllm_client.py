"""The trainer's side of the gloo weight transfer (`dualrun.weightsync.engine.transfer`), given to TRL's `VLLMClient`;
the wire both sides agree on is `dualrun.weightsync.wire`.

Why: TRL 1.16's `VLLMClient` opens vLLM's NCCL endpoint in `init_communicator` (and refuses a non-CUDA device),
broadcasts through `packed_nccl_broadcast_producer` (CUDA streams) in `update_named_params`, and closes the NCCL
group's socket in `close_communicator`. When the server it talks to reports `{"backend": "gloo"}` (dualrun starts
vLLM's CPU build that way), those three methods take the gloo path here instead; against any other server they
are TRL's own. GRPOPlugin installs this from the rank's import hook, so the user's script is unchanged. On both
paths, before each sync, the group is formed again when the rollout router's members changed (`regroup`).

The protocol is TRL's: the same `init_info` (the trainer is rank 0, the workers from `rank_offset` 1), the same
`/start_weight_update`, `/update_weights` (posted while the trainer broadcasts), `/finish_weight_update` calls.
"""
from __future__ import annotations

import atexit
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterator

from dualrun.weightsync.wire import GLOO_BACKEND, PACKED_BUFFER_BYTES, GroupNotFormed
from dualrun.weightsync.trainer import regroup

_INSTALLED = "_dualrun_gloo"


class GlooEndpoint:
    """Rank 0 of the weight-sync group: streams the trainer's tensors down the group's chain
    (`dualrun.weightsync.stream.Sender`: chunks packed as vLLM packs them, the next packed while the last is on the
    wire, into two buffers kept from sync to sync)."""

    def __init__(self, group: Any, buffer_bytes: int) -> None:
        from dualrun.weightsync.stream import Sender

        self.group, self.buffer_bytes = group, buffer_bytes
        self.sender = Sender(group, buffer_bytes)

    def send(self, named: Iterator[tuple[str, Any]]) -> None:
        self.sender.send(tensor.detach().cpu() for _, tensor in named)

    def close(self) -> None:
        from dualrun.weightsync.wire import close_group

        group, self.group = self.group, None
        self.sender.buffers = [None] * len(self.sender.buffers)
        if group is not None:
            close_group(group)


def server_backend(client: Any) -> str | None:
    """The weight-transfer backend the server reports (None: it has none)."""
    config = client.get_server_info().get("weight_transfer_config")
    return config.get("backend") if isinstance(config, dict) else None


def open_endpoint(port: int, server_world_size: int, join: Callable[[dict], Any],
                  server: str = "the rollout server") -> GlooEndpoint:
    """The trainer's end of a gloo weight-sync group (rank 0, the server's workers from `rank_offset` 1): `join`
    posts TRL's init_info to `server` (its URL), which joins while this process opens the group. TRL's VLLMClient
    and AsyncGRPOTrainer's client (dualrun/weightsync/trainer/async_client.py) differ only in how they post it.
    Forming is bounded (`weight_sync_timeout_s`): past it, GroupNotFormed names both ends; a join the server
    refuses (the router's init check, say) ends the wait at once, naming the server and its answer."""
    from vllm.utils.network_utils import get_ip

    from dualrun.weightsync.wire import form_timeout_s, open_group

    init_info = {"master_address": get_ip(), "master_port": port, "rank_offset": 1,
                 "world_size": server_world_size + 1, "packed": True,
                 "packed_buffer_size_bytes": PACKED_BUFFER_BYTES}
    joined = in_daemon(join, init_info)   # a post that never returns (TRL's client retries) must not hold the exit
    formed = in_daemon(open_group, init_info["master_address"], port, 0, init_info["world_size"])
    try:
        group = first_of(formed, joined, server)
    except GroupNotFormed as e:
        if e.__cause__ is None:   # refused: the line is whole (the forming thread, a daemon, waits out its bound)
            raise
        raise GroupNotFormed(not_formed_line(init_info["master_address"], port, server, server_world_size,
                                             form_timeout_s(), str(e.__cause__), answer(joined))) from None
    joined.result()
    return GlooEndpoint(group, PACKED_BUFFER_BYTES)


def first_of(formed: "Future[Any]", joined: "Future[Any]", server: str) -> Any:
    """The group once `formed`; GroupNotFormed (no cause) as soon as the `joined` post failed first (the server
    refused to join: its group will never form, so the trainer does not wait out its bound), GroupNotFormed with
    the group's own error as its cause when forming failed."""
    while not formed.done():
        wait([formed, joined], return_when=FIRST_COMPLETED)
        if not formed.done() and joined.done() and joined.exception() is not None:
            raise GroupNotFormed(f"the rollout server at {server} refused to join the weight-sync group, so it "
                                 f"cannot form: {answer(joined)}")
        if joined.done():
            wait([formed])
    try:
        return formed.result()
    except GroupNotFormed as e:
        raise GroupNotFormed(str(e)) from (e.__cause__ or e)


def in_daemon(fn: Callable[..., Any], *args: Any) -> "Future[Any]":
    """`fn(*args)` in a daemon thread: unlike a ThreadPoolExecutor's, the interpreter does not wait for it at exit."""
    import threading

    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever reads the future
            future.set_exception(e)
    threading.Thread(target=run, name="dualrun-weight-sync-join", daemon=True).start()
    return future


def answer(joined: "Future[Any]", grace_s: float = 10.0) -> str:
    """What the server said to the join post, once the group failed here (its side has the same bound)."""
    try:
        joined.result(timeout=grace_s)
    except FutureTimeout:
        return f"no answer to the join {grace_s:g} s later (its log says its side)"
    except Exception as e:  # noqa: BLE001 - the server's refusal, whatever the HTTP client raises
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {' '.join(lines)[:400]}" if lines else type(e).__name__
    return "it joined"


def not_formed_line(address: str, port: int, server: str, workers: int, bound_s: float, here: str,
                    said: str) -> str:
    """Pure: the one line that ends a job whose weight-sync group did not form, naming both ends."""
    ranks = "rank 1" if workers == 1 else f"ranks 1-{workers}"
    here = " ".join(here.strip().splitlines())[:300]
    return (f"the weight-sync group did not form within {bound_s:g} s (weight_sync_timeout_s): trainer rank 0 at "
            f"{address}:{port} and the rollout server at {server} ({ranks} of {workers + 1}); trainer rank 0: "
            f"{here}; the server: {said}")


def init_gloo(client: Any) -> None:
    """TRL's `init_communicator`, over gloo: the server joins while this process opens the group as rank 0."""
    client.communicator = open_endpoint(
        client.group_port, client.get_world_size(),
        lambda info: client._post(f"{client.base_url}/init_weight_transfer_engine", json={"init_info": info}),
        client.base_url)
    atexit.register(client.close_communicator)


def send_gloo(client: Any, metadata: list[tuple[str, str, list[int]]], named: Iterator[tuple[str, Any]]) -> None:
    """TRL's `update_named_params`, over gloo: announce the tensors, then broadcast them while the server receives."""
    names, dtype_names, shapes = (list(field) for field in zip(*metadata, strict=True))
    update_info = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
    if not client._updating_weights:
        client._start_weight_update()
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        received = pool.submit(client._post, f"{client.base_url}/update_weights", json={"update_info": update_info})
        client.communicator.send(named)
        received.result()
    finally:
        pool.shutdown(wait=False)   # after a failed broadcast the post may never return; don't wait for it here
    if not client._updating_weights:
        client._finish_weight_update()


def install(module: Any) -> None:
    """Give `module.VLLMClient` (trl.generation.vllm_client) the gloo path for servers that report gloo, and (either
    path) a weight-sync group that follows the rollout router's members (dualrun/weightsync/trainer/regroup.py)."""
    cls = module.VLLMClient
    if getattr(cls, _INSTALLED, False):
        return
    trl_init, trl_update, trl_close = cls.init_communicator, cls.update_named_params, cls.close_communicator

    def init_communicator(self, device: Any = 0) -> None:
        regroup.remember(self, device)   # the router's membership this group is formed under
        if server_backend(self) != GLOO_BACKEND:
            return trl_init(self, device)
        init_gloo(self)

    def update_named_params(self, metadata, named_params) -> None:  # noqa: ANN001 - TRL's signature
        regroup.reform_if_changed(self)   # a replica left or joined behind the router: the group of now
        if not isinstance(self.communicator, GlooEndpoint):
            return trl_update(self, metadata, named_params)
        send_gloo(self, metadata, named_params)

    def close_communicator(self) -> None:
        if not isinstance(self.communicator, GlooEndpoint):
            return trl_close(self)
        endpoint, self.communicator = self.communicator, None
        endpoint.close()

    for fn, trl_fn in ((init_communicator, trl_init), (update_named_params, trl_update),
                       (close_communicator, trl_close)):
        fn.__doc__ = f"{trl_fn.__doc__ or ''}\n\n(dualrun: over gloo when the server reports the gloo backend.)"
        setattr(cls, trl_fn.__name__, fn)
    setattr(cls, _INSTALLED, True)

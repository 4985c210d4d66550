"""A role program whose two-worker `prm` group all-reduces in a torch.distributed process group of its own
(tests/e2e/test_role_groups_e2e.py). Run it with `dualrun launch --backend torchrun|ray --config_file C this.py OUT`."""
import json
import os
import sys

import dualrun

GROUP_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FROM_RUNTIME_ENV = "GROUP_TEST_FROM_RUNTIME_ENV"   # set only by the config's ray.runtime_env.env_vars


def by_rank(n, i, *args, **kwargs):
    """A dispatch function with ms-swift's signature: worker i of n gets item i of the first argument."""
    return (args[0][i],), kwargs


@dualrun.worker(group="prm")
class Reducer:
    def __init__(self):
        import torch.distributed as dist

        dist.init_process_group("gloo")   # no arguments: the group's own RANK / WORLD_SIZE / MASTER_*
        self.env = {k: os.environ[k] for k in GROUP_VARS}
        self.env[FROM_RUNTIME_ENV] = os.environ.get(FROM_RUNTIME_ENV)

    @dualrun.function(dispatch=by_rank)
    def total(self, x):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(x)])
        dist.all_reduce(t)
        return {"sum": t.item(), "rank": dist.get_rank(), "world": dist.get_world_size(), "pid": os.getpid(),
                **self.env}


if __name__ == "__main__":
    with open(sys.argv[1] + ".runs", "a") as f:   # one line per run of the program: a single controller runs once
        f.write(f"{os.getpid()}\n")
    results = Reducer().total([1, 2])
    with open(sys.argv[1], "w") as f:
        json.dump({"results": results, "pid": os.getpid(), "RANK": os.environ.get("RANK")}, f)

"""A stand-in trainer that uses its teacher server every step: a step is a /health call to the address dualrun
wired in, then a "checkpoint" file; it records the address each attempt saw. argv: OUT STEPS [WAIT], WAIT the
seconds a call may take (default 5; `none`: no limit, as TRL's server-mode client waits)."""
import json
import os
import sys
import time
import urllib.request

out, steps = sys.argv[1], int(sys.argv[2])
wait = None if sys.argv[3:] == ["none"] else float((sys.argv[3:] or ["5"])[0])
rank = os.environ["RANK"]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + int(os.environ.get("DUALRUN_JOB_RESTARTS", "0"))
address = os.environ["DUALRUN_TEACHER_ADDRESS"]
with open(os.path.join(out, f"address_{attempt}_{rank}.json"), "w") as f:
    json.dump(address, f)
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
done = len([n for n in os.listdir(out) if n.startswith(f"step_{rank}_")])   # resume from the last "checkpoint"
for step in range(done, steps):
    with opener.open(f"http://{address}/health", timeout=wait) as r:
        assert r.status == 200
    open(os.path.join(out, f"step_{rank}_{step}"), "w").close()
    print(f"rank {rank} attempt {attempt} step {step}", flush=True)
    time.sleep(0.5)
print(f"rank {rank} finished", flush=True)

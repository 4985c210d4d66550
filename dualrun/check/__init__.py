"""`dualrun check`: the pre-flight (`preflight`) over each node's facts (`node_facts`), with the weight-sync
rehearsal of `dualrun.weightsync.rehearsal`."""

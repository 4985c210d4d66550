"""Every Ray actor class, worker side: the actor behind one rank (`rank`), behind one server (`server`), and behind
one worker of a role program (`role`). Imported inside Ray worker processes: nothing here imports the launchers,
the config or the plan."""

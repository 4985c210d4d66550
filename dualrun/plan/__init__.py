"""The plan, a pure function of the config and the cluster: every process, where it runs and with which env
(`processes`), the few decisions in which the backends differ (`placement`) and the shape of a separate role's
engines (`engines`). No Ray, no torch, no process started."""

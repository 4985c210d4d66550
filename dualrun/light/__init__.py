"""Standard-library-only modules: what a Ray worker, a role worker or a server process imports before (and
without) torch, Ray or the rest of dualrun - free ports, dying with the parent, the interpreter placeholder, a
pipe's lines, progress-bar collapsing, and the one child-process class (own process group, SIGTERM, grace,
SIGKILL). tests/unit/test_light.py holds them to it."""

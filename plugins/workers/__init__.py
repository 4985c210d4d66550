"""The worker halves of the built-in method plugins (installed as `dualrun.plugins.workers`): `<method>.activate`
installs the method's import hooks in every worker before the user's script runs (dualrun/rank/method.py finds it).
Each imports only the worker side (dualrun.rank, dualrun.contract.protocol): tests/unit/test_layers.py checks it."""

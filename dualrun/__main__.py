from dualrun.cli import entry

entry()

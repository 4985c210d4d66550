"""Programs that run as processes of their own, apart from their drivers: dualrun's CPU inference engine
(`cpu_engine`) and the replica router (`router`, with its pure request rules `routing` and rotation table
`rotation`). Starting, watching and stopping them is dualrun/servers/'s job; their command lines are built in
dualrun/methods/commands.py."""

"""Built-in method plugins (installed as `dualrun.plugins`): one small module per method."""

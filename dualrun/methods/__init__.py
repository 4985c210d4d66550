"""Method plugins, their driver half: which roles a method has, how they are validated (`plugin`), and the catalogue
of command lines a separate role's servers run (`commands`). The worker half is `dualrun.rank.method`."""

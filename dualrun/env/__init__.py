"""What reaches a worker's environment, and the launching environment's own checks: the allow-list and the
variables every worker gets (`worker`), accelerate's variables for a config (`accelerate`), the `DUALRUN_*` /
`RAY_ADDRESS` variables checked like config keys (`variables`), the launching shell's variables that do not reach
the workers (`unforwarded`), and what is installed here (`installed`, `dualrun env`)."""

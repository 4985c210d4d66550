"""Rank side (the worker side): what runs inside a rank, apart from the driver-side process management.

The one entry point (`bootstrap`); a method plugin's worker half, found and activated (`method`); the import hooks
plugins use (`hooks`); filling trainer-config fields the user left at their defaults (`wiring`, `trainer_defaults`);
resuming after a restart (`resume`); the exit guard (`exit_guard`) and the process groups kept to the exit
(`keep_groups`); sharing server addresses through torchrun's store (`store_wiring`); the separate teacher's client
and loss (`teacher`, `topk_loss`); the trainer's end of the gloo weight transfer (`gloo_client`). Nothing here reaches the driver side (the config, the plan, a plugin's driver half,
the server programs, the lifecycle, the launchers), even through another module: tests/unit/test_layers.py checks it.
"""

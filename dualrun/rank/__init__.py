"""Rank side (the worker side): what runs inside a rank, apart from the driver-side process management.

The one entry point (`bootstrap`); the import hooks plugins use (`hooks`); filling trainer-config fields the user
left at their defaults (`wiring`, `trainer_defaults`); resuming after a restart (`resume`); the exit guard
(`exit_guard`); sharing server addresses through torchrun's store (`store_wiring`); the separate teacher's client
and loss (`teacher`, `topk_loss`). Nothing here imports the driver-side packages (launchers, servers, roles, the Ray
layer): tests/test_layers.py checks it.
"""

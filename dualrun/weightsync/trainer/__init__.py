"""The trainer's side of the weight sync (worker side: imported inside a rank, never by the driver)."""

"""The driver-worker contract, the lowest layer: the variables passed between them (`protocol`), the one-line
errors (`errors`), the redaction rule for secrets (`redact`), the store keys of machines started by hand
(`job_store`) and how a function and its results travel (`calls`). Standard library only."""

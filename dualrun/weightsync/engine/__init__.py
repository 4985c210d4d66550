"""The engine's side of the weight sync: code vLLM loads in its own processes (its general plugin and the gloo
weight-transfer engine). Standard library only at import."""

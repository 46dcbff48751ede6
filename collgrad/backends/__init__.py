"""Backend families and the registry that agrees on them per process group."""

"""How ops run fast on a target: the kernel layer (see docs/architecture.md)."""

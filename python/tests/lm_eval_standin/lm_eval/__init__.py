"""Stand-in for lm-eval (see ../README.md)."""

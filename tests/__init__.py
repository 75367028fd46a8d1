"""tripod's test suite: tests/unit (in-process) and tests/multiprocess (gloo worlds, launched CLIs)."""

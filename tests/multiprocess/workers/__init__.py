"""Scripts that tests/multiprocess launches under torchrun (or as a CLI); each is also importable."""

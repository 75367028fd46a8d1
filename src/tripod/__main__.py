"""`python -m tripod ...` (what torchrun and srun launch) is the `tripod` console script."""
from tripod.engine.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

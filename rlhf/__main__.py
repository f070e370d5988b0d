"""`python -m rlhf ...` is the same as the `rlhf` console script (works under torchrun and srun)."""

from rlhf.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())

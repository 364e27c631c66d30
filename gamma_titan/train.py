"""`torchrun ... -m gamma_titan.train --job.config_file CONFIG.toml` (and `python -m
gamma_titan.train` for one process): the training entry point, gamma_titan/training/main.py."""

from gamma_titan.training.main import main

if __name__ == "__main__":
    main()

"""`torchrun ... -m gamma_titan.train --job.config_file CONFIG.toml` (and `python -m
gamma_titan.train` for one process): the training entry point, gamma_titan/training/main.py."""

if __name__ == "__main__":
    from gamma_titan.training import start_signals

    start_signals.hold()  # before the seconds of imports: a stop signal then is kept, not fatal
    from gamma_titan.training.main import main

    main()
else:
    from gamma_titan.training.main import main  # noqa: F401  (the entry point, importable)

"""Training on TorchTitan: from a command line to a finished (or preempted) run.

  main          the entry point (`-m gamma_titan.train`): parse, pre-flight, start-up summary, train
  preflight     every check that can run before a process group starts (one-line errors)
  derive        settings a config leaves to the machine (HSDP, expert-parallel degree, float8 filter)
  train_spec    a model family's TrainSpec: its model with our data, tokenizer and metrics
  optimizer     which parameters AdamW decays ([optimizer] weight_decay_policy)
  trainer       GammaTrainer: TorchTitan's Trainer with the step guard, SIGTERM and live diagnostics
  checkpoint    GammaCheckpointManager: TorchTitan's, with the rules a multi-week run needs
  reliability   the step guard, graceful stop and checkpoint-folder rules
  metrics       metrics.jsonl and TensorBoard: TorchTitan's logs plus diagnostics and MoE load
  run_record    the resolved config, versions and command of each run
  launch        torchrun and SLURM settings (shutdown timeout, stop grace)
"""

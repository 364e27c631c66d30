"""Training on TorchTitan: from a command line to a finished (or preempted) run.

  main          the entry point (`-m gamma_titan.train`): parse, pre-flight, start-up summary, train
  preflight     every check that can run before a process group starts (one-line errors)
  derive        settings a config leaves to the machine (HSDP, expert-parallel degree, float8 filter)
  layout        the [parallelism] degrees resolved, and the layouts refused (each naming one that works)
  pipeline      the pipeline stages TorchTitan will cut, and the schedules and splits refused
  train_spec    registers each family's TrainSpec with our data, tokenizer, metrics, validator and DDP sums
  validator     GammaValidator: TorchTitan's Validator reading shard datasets with our loader
  optimizer     which parameters AdamW decays ([optimizer] weight_decay_policy)
  trainer       GammaTrainer: TorchTitan's Trainer with the step guard, SIGTERM and live diagnostics
  checkpoint    GammaCheckpointManager: TorchTitan's, with the rules a multi-week run needs
  step_guard    the non-finite step guard and loss spikes ([gamma.reliability])
  graceful_stop SIGTERM or Ctrl-C: finish the step, checkpoint it, exit 0 (or 143 after the grace period)
  start_signals a stop signal while a rank starts up: kept for the graceful stop, not fatal
  checkpoint_folders  which checkpoints a folder holds and where they stood; keep-last-K over complete ones
  metrics       metrics.jsonl and TensorBoard: TorchTitan's logs plus diagnostics, MoE load, progress
  console       train.log in the run folder, colour only for a terminal, CPU noise, the last lines
  run_record    the resolved config, versions and command of each run
  run_lock      one live run per dump folder: .run.lock (host, pid, start, SLURM job), stale locks ignored
  agreement     what rank 0 reads in the run folder, taken by every rank (finished? resume from which step?)
  launch        torchrun and SLURM settings (shutdown timeout, stop grace)
  torchrun      torchrun with the exit codes a scheduler reads: 0 after a clean stop, no traceback
"""

"""gamma-titan: TorchTitan pretraining with γ-initialisation, a small RMSNorm ε and gated
attention ("Small Initialization Matters for Large Language Models").

Importing the package imports nothing heavy (so `gamma-titan --help` answers at once). It
installs one import hook: on a machine without an accelerator, TorchTitan's device
detection, which runs when `torchtitan.tools.utils` is first imported and binds its device
for good, is made to answer "cpu" (`gamma_titan.cpu_fallback`). So gamma_titan must be
imported before torchtitan; any later import of torchtitan, anywhere, gets the CPU.

The model families and datasets are registered with TorchTitan by
`gamma_titan.training.train_spec` (imported by everything that trains or resolves a model;
TorchTitan's own trainer takes it as `--experimental.custom_import gamma_titan.training.train_spec`).
"""

from gamma_titan.cpu_fallback import install_import_hook

install_import_hook()

__version__ = "0.1.0"

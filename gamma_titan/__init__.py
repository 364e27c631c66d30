"""gamma-titan: TorchTitan pretraining with γ-initialisation, a small RMSNorm ε and gated
attention ("Small Initialization Matters for Large Language Models").

Importing the package prepares TorchTitan for the machine (CPU fallback, see
`gamma_titan.platform`), registers the TrainSpecs (`gamma_dense`) and the built-in
datasets. It must be imported before `torchtitan` on a machine without a GPU.
"""

from gamma_titan import platform as _platform

_platform.apply()

from gamma_titan.data.datasets import register_datasets  # noqa: E402
from gamma_titan.train_specs import register as _register_train_specs  # noqa: E402

_register_train_specs()
register_datasets()

__version__ = "0.1.0"

"""gamma-titan: TorchTitan pretraining with γ-initialisation, a small RMSNorm ε and gated
attention ("Small Initialization Matters for Large Language Models").

Importing the package prepares TorchTitan for the machine (CPU fallback, see
`gamma_titan.cpu_fallback`), and registers the model families' TrainSpecs with TorchTitan
(`gamma_titan.training.train_spec`) and the built-in datasets. It must be imported before
`torchtitan` on a machine without a GPU.
"""

from gamma_titan import cpu_fallback

cpu_fallback.apply()

from gamma_titan.data.registry import register_datasets  # noqa: E402
from gamma_titan.training.train_spec import register_families  # noqa: E402

register_families()
register_datasets()

__version__ = "0.1.0"

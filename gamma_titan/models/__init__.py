"""Model families: `dense` (gamma_dense); layers shared between families live in `common`."""

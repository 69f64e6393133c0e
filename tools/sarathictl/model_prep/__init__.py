"""Model folders for sarathi-cluster: the demo model (SmolLM2-135M-Instruct) from its GGUF.

    from sarathictl.model_prep.prepare import PrepareOptions, prepare_model
    prepared = prepare_model(PrepareOptions(model_dir=Path("models/smollm2")))

or `sarathictl model prepare-demo DIR`, or `python -m sarathictl.model_prep DIR`. This package
file stays free of torch and gguf imports so that the CLI starts fast; the work is in prepare.py.
"""

from sarathictl.model_prep.defaults import DTYPE_NAMES, default_cache_dir, default_model_dir
from sarathictl.model_prep.errors import ModelPrepError

__all__ = ["DTYPE_NAMES", "ModelPrepError", "default_cache_dir", "default_model_dir"]

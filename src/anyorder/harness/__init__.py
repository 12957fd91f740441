"""EleutherAI's evaluation harness (``lm_eval``) on anyorder models: importing this package
registers the ``anyorder`` model (needs ``pip install anyorder[eval]``)."""

from anyorder.harness.backend import AnyorderLM
from anyorder.harness.run import run_harness

__all__ = ["AnyorderLM", "run_harness"]

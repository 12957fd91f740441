"""anyorder: decoder-only masked diffusion language models.

AO-GPT (arXiv 2506.19935) and ARMD (arXiv 2601.16971) with a left-to-right GPT and an
encoder-only masked diffusion baseline, sharing one transformer trunk. Importing this
package touches no GPU and downloads nothing.
"""

from anyorder.config import ModelConfig, RunConfig, load_config, preset
from anyorder.errors import AnyorderError
from anyorder.models import build_model

__all__ = ["AnyorderError", "ModelConfig", "RunConfig", "build_model", "load_config", "preset"]
__version__ = "0.1.0"

"""Moved to :mod:`anyorder.evaluation.detokenize`; kept until the layout merge."""

from anyorder.evaluation.detokenize import *  # noqa: F403

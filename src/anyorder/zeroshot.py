"""Moved to :mod:`anyorder.evaluation.zeroshot` and `.zeroshot_table`; kept until the merge."""

from anyorder.evaluation.zeroshot import *  # noqa: F403
from anyorder.evaluation.zeroshot_table import *  # noqa: F403

"""Moved to :mod:`anyorder.evaluation.genppl`; kept until the layout merge."""

from anyorder.evaluation.genppl import *  # noqa: F403

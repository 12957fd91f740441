"""Moved to :mod:`anyorder.evaluation.report`; kept until the layout merge."""

from anyorder.evaluation.report import *  # noqa: F403

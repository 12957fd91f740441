"""Moved to :mod:`anyorder.evaluation.estimators`; kept until the layout merge."""

from anyorder.evaluation.estimators import *  # noqa: F403

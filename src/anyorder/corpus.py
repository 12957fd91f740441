"""Moved to :mod:`anyorder.evaluation.corpus` and `.suite`; kept until the layout merge."""

from anyorder.evaluation.corpus import *  # noqa: F403
from anyorder.evaluation.report import format_likelihood, report_unit  # noqa: F401
from anyorder.evaluation.suite import *  # noqa: F403

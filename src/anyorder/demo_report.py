"""Moved to :mod:`anyorder.demo.report`; kept until the layout merge."""

from anyorder.demo.report import *  # noqa: F403
from anyorder.demo.report import (  # noqa: F401
    _fence,
    _recipe_section,
    _sample_block,
    _samples_section,
    _share,
    _validation_section,
)

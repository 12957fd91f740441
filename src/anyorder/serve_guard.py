"""Moved to :mod:`anyorder.serve.guard`; kept until the layout merge."""

from anyorder.serve.guard import *  # noqa: F403
from anyorder.serve.guard import _HOST, _LENGTH, _ip  # noqa: F401

"""``python -m anyorder.cli``: the console script (as under torchrun)."""

import sys

from anyorder.cli.main import main

sys.exit(main())

"""``python -m anyorder.harness ...``: the harness's own command line (``lm_eval``), with the
``anyorder`` model registered; an anyorder error is one line and exit status 2."""

from anyorder.harness.run import main

if __name__ == "__main__":
    main()

"""`python -m tfpar`: the tfpar command line."""

import sys

from tfpar import cli

sys.exit(cli.main())

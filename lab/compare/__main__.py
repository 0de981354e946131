"""`python -m lab.compare`: see lab/compare/cli.py."""

import sys

from lab.compare.cli import main

sys.exit(main())

"""`python -m rlhf.compare`: see rlhf/compare/cli.py."""

import sys

from rlhf.compare.cli import main

sys.exit(main())

"""`python -m servelm ...`: the `servelm` command."""

import sys

from servelm.cli import main

sys.exit(main())

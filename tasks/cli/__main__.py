"""`python -m tasks.cli ...`: the `retrainer` command without the installed script."""

import sys

from tasks.cli import main

sys.exit(main())

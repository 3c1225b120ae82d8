"""`python -m tasks.plan CONFIG [...]`: run the planner without the other verbs."""

import sys

from tasks.plan.cli import main

sys.exit(main())

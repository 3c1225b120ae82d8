"""Airflow's per-deployment settings hook: every Airflow process imports this module at start-up (the
plugins folder is on its sys.path), before it scans the plugins folder.

It silences one warning, by its text: the task SDK reads `plugins/.airflowignore` with pathspec's
`GitWildMatchPattern` whatever `[core] dag_ignore_file_syntax` says, and pathspec deprecated that class,
so every task log started with a DeprecationWarning nobody can act on. Task processes are forked from
the processes that imported this, so the filter holds there too.
"""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", message=r"GitWildMatchPattern \('gitwildmatch'\) is deprecated",
                        category=DeprecationWarning)

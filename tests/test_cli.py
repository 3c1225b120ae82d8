"""The CLI's verb table: every verb a stage module registers is in it, and a verb loads only its module."""

from __future__ import annotations

import argparse
import subprocess
import sys

from tasks import cli


def _verbs(parser: argparse.ArgumentParser) -> set[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def test_verb_table_matches_what_the_modules_register() -> None:
    assert _verbs(cli.build_parser()) == set(cli.COMMAND_MODULES)
    for verb, module in cli.COMMAND_MODULES.items():
        owned = {v for v, m in cli.COMMAND_MODULES.items() if m == module}
        assert _verbs(cli.build_parser([verb, "--help"])) == owned, verb


def test_a_verb_imports_only_its_own_module() -> None:
    probe = ("import sys, tasks.cli; tasks.cli.build_parser(['-v', 'warm-url', 'x', 'y']); "
             "print(sorted(m for m in cli_mods if m in sys.modules))")
    mods = sorted(set(cli.COMMAND_MODULES.values()))
    out = subprocess.run([sys.executable, "-c", f"cli_mods = {mods!r}; {probe}"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "['tasks.cli.warm']"

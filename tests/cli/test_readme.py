"""The README's two newcomer commands stay true: CI runs the test command verbatim, the example exists."""

import re

from conftest import ROOT


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_ci_runs_the_readme_test_command():
    run_cmd, test_cmd = quick_start_commands()
    assert "pytest" in test_cmd
    ci_lines = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines


def test_main_command_solves_a_shipped_example():
    run_cmd, _ = quick_start_commands()
    path = re.search(r"zoomr solve (\S+)", run_cmd).group(1)
    assert (ROOT / path).is_file()

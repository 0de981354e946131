"""The top level's requirements.txt installs what pyproject.toml's dependencies say, line for line, and the
README's two commands stay one line each."""

import os
import re

from helpers import REPO


def requirement_lines(text: str) -> list[str]:
    """Requirement specifiers, comments and blank lines dropped, spaces removed."""
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    return [line.replace(" ", "") for line in lines if line]


def pyproject_dependencies() -> list[str]:
    """[project] dependencies of pyproject.toml (read as text: tomllib is not in Python 3.10)."""
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        block = re.search(r"^dependencies = \[\n(.*?)^\]", f.read(), flags=re.M | re.S).group(1)
    return [re.search(r'"([^"]+)"', line).group(1).replace(" ", "") for line in block.splitlines()
            if line.strip().startswith('"')]


def test_requirements_txt_is_pyprojects_dependencies():
    dependencies = pyproject_dependencies()
    assert len(dependencies) >= 6 and dependencies[0].startswith("torch")  # the parse found the list
    with open(os.path.join(REPO, "requirements.txt")) as f:
        assert requirement_lines(f.read()) == dependencies


def test_the_readmes_install_and_test_commands_are_one_line_each():
    with open(os.path.join(REPO, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), flags=re.S)
    commands = [line for block in blocks for line in block.splitlines() if "pip install" in line]
    assert len(commands) == 2 and "python train.py" in commands[0] and "pytest" in commands[1]
    assert not any(line.rstrip().endswith("\\") for block in blocks for line in block.splitlines())

"""The examples of python/README.md run, in order, in one namespace from the source directory."""

import os
import re

from conftest import SOURCE_DIR

README = SOURCE_DIR / "python" / "README.md"


def blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(blocks()) >= 3


def test_readme_examples_run(tmp_path):
    here = os.getcwd()
    os.chdir(SOURCE_DIR)
    try:
        namespace = {"__name__": "readme", "TMP": str(tmp_path)}
        for i, code in enumerate(blocks()):
            exec(compile(code, f"{README}:block{i + 1}", "exec"), namespace)
    finally:
        os.chdir(here)

"""Shared fixtures: the package from the build tree (PYTHONPATH=build/python, set by CTest), the demo model
(models/demo), the tools in build/bin and the shared data (tests skip when it is absent)."""

import os
from pathlib import Path

import pytest

SOURCE_DIR = Path(os.environ.get("TQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BIN_DIR = Path(os.environ.get("TQ_BIN_DIR", SOURCE_DIR / "build" / "bin"))
SHARED_DIR = Path(os.environ.get("TQ_SHARED_DIR", SOURCE_DIR.parent / "shared"))
DEMO = SOURCE_DIR / "models" / "demo"
CHAT_TEMPLATE = SOURCE_DIR / "tests" / "serve" / "chat_template.jinja"


def tool(name):
    path = BIN_DIR / name
    if not path.exists():
        pytest.fail(f"{path} is missing: build it (cmake --build build --target {name})")
    return str(path)


@pytest.fixture(scope="session")
def tq():
    import turboquant

    return turboquant


@pytest.fixture(scope="session")
def demo(tq):
    """The demo model on the CPU with a K8/V3 cache, two threads (what turboquant-generate runs by default)."""
    return tq.load(DEMO, kv="k8v3", threads=2)


@pytest.fixture(scope="session")
def demo_chat(tq):
    """The demo model with the plain transcript template the server's tests use."""
    return tq.load(DEMO, kv="k8v3", threads=2, chat_template=CHAT_TEMPLATE.read_text())

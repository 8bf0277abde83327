"""The guard of `make test-fast` (tests/conftest.py): under MAPL_TEST_IN_PROCESS=1 an unmarked test that starts
a child process fails and names the marker it lacks, also when the process starts in a module-scoped fixture
(set up before any function-scoped fixture could patch anything)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODULE = '''
import subprocess
import pytest

@pytest.fixture(scope="module")
def child():
    return subprocess.run([{python!r}, "-c", "print(1)"], capture_output=True, text=True).stdout

{marker}
def test_uses_a_module_fixture_that_spawns(child):
    assert child.strip() == "1"
'''


@pytest.mark.process
@pytest.mark.parametrize("marker,passes", [("", False), ("@pytest.mark.process", True)])
def test_a_module_fixture_cannot_start_a_child_process_for_an_unmarked_test(tmp_path, marker, passes):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_spawn.py").write_text(MODULE.format(python=sys.executable, marker=marker))
    env = {**os.environ, "MAPL_TEST_IN_PROCESS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                        str(tmp_path / "test_spawn.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    if passes:
        assert p.returncode == 0, p.stdout + p.stderr
    else:
        assert p.returncode == 1 and "starts a child process" in p.stdout and "pytest.mark.process" in p.stdout, p.stdout

"""Builds the torch-free C++ test with g++ alone (no torch headers on the include path) and runs it."""
import glob
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "schedule", "*.cpp"))) + [
    os.path.join(ROOT, "tests", "schedule", "cpp", "test_schedule.cpp")]


def test_schedule_sources_include_no_torch():
    for path in glob.glob(os.path.join(ROOT, "csrc", "schedule", "*")):
        with open(path) as f:
            assert "#include <torch" not in f.read() and "ATen" not in open(path).read(), path


def test_cpp_unit_test(tmp_path):
    compiler = os.environ.get("CXX_FOR_TESTS", "g++")
    if shutil.which(compiler) is None:
        pytest.fail(f"{compiler} not found; the C++ unit test needs a C++17 compiler")
    flags = ["-std=c++17", "-O1", f"-I{os.path.join(ROOT, 'csrc')}"]

    def compile_one(src):
        obj = str(tmp_path / (os.path.basename(src) + ".o"))
        subprocess.run([compiler, *flags, "-c", src, "-o", obj], check=True, capture_output=True, text=True)
        return obj

    with ThreadPoolExecutor(max_workers=2) as pool:  # the machine has 2 cores
        objects = list(pool.map(compile_one, SOURCES))
    binary = str(tmp_path / "test_schedule")
    subprocess.run([compiler, *objects, "-o", binary], check=True)
    result = subprocess.run([binary], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "all checks passed" in result.stdout

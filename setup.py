"""Builds torchpp's C++ extensions against the installed torch.

Three extension modules, one per layer of the architecture:
  torchpp._C         torch.ops.torchpp (csrc/ops) and the pipeline runtime (csrc/runtime)
  torchpp._schedule  the torch-free schedule compiler (csrc/schedule) behind pybind11
  torchpp._plan      the torch-free partitioner and memory model (csrc/plan) behind pybind11

Build with `pip install --no-build-isolation -e .` (build isolation would download
another torch). TORCHPP_BUILD=schedule,plan limits a build to some modules, so the
torch-free parts rebuild in seconds while the ops are untouched. TORCHPP_CXX_STD=17 or 20
picks the C++ standard; unset, torch's own choice applies (C++17 up to torch 2.12, C++20 from
2.13, whose headers use C++20 features that C++17 builds accept with a warning). Objects carry
no debug info unless TORCHPP_DEBUG_INFO=1 (it more than doubles the compile time).

Supported torch: TORCH_RANGE below (CPU and CUDA builds alike; the extension itself has no CUDA
code, so one build serves both).
"""
import glob
import os
import re

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
# The torch versions torchpp is built and tested with: [lowest, first unsupported).
TORCH_RANGE = ((2, 11), (2, 14))


def check_torch(version: str) -> None:
    found = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", version).groups())
    if not TORCH_RANGE[0] <= found < TORCH_RANGE[1]:
        raise SystemExit(f"torchpp supports torch >= {'.'.join(map(str, TORCH_RANGE[0]))}, < "
                         f"{'.'.join(map(str, TORCH_RANGE[1]))}; the installed torch is {version}")


def cxx_flags(standard: str, debug_info: bool) -> list:
    # Python's own CFLAGS carry -g: debug info of torch's templates more than doubles the compile
    # (the bindings unit: 83 s -> 36 s with -g0); TORCHPP_DEBUG_INFO=1 keeps it for debuggers.
    flags = ["-O2", "-fvisibility=hidden"] + ([] if debug_info else ["-g0"])
    if not standard:
        return flags  # torch appends its own -std
    if standard not in ("17", "20"):
        raise SystemExit(f"TORCHPP_CXX_STD must be 17 or 20, got {standard!r}")
    return flags + [f"-std=c++{standard}"]


check_torch(torch.__version__)
CXX_FLAGS = cxx_flags(os.environ.get("TORCHPP_CXX_STD", ""), os.environ.get("TORCHPP_DEBUG_INFO") == "1")


def sources(*patterns):
    found = []
    for pattern in patterns:
        found += sorted(glob.glob(os.path.join(ROOT, pattern)))
    return [os.path.relpath(path, ROOT) for path in found]


def extension(name, patterns):
    return CppExtension(
        name=f"torchpp.{name}",
        sources=sources(*patterns),
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": CXX_FLAGS},
    )


MODULES = {
    "C": ["csrc/ops/*.cpp", "csrc/runtime/*.cpp", "csrc/schedule/ir.cpp", "csrc/schedule/trace.cpp", "csrc/bindings/c_module.cpp"],
    "schedule": ["csrc/schedule/*.cpp", "csrc/bindings/schedule_module.cpp"],
    "plan": ["csrc/plan/*.cpp", "csrc/bindings/plan_module.cpp"],
}

wanted = os.environ.get("TORCHPP_BUILD", ",".join(MODULES)).split(",")
unknown = [name for name in wanted if name not in MODULES]
if unknown:
    raise SystemExit(f"TORCHPP_BUILD names unknown modules {unknown}; known: {sorted(MODULES)}")
ext_modules = [extension(f"_{name}", MODULES[name]) for name in wanted if sources(*MODULES[name])]

setup(
    name="torchpp",
    version="0.1.0",
    description="PTD-P (pipeline x tensor x data) parallelism for PyTorch models",
    packages=find_packages(include=["torchpp", "torchpp.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=[f"torch>={'.'.join(map(str, TORCH_RANGE[0]))},<{'.'.join(map(str, TORCH_RANGE[1]))}"],
)

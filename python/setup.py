"""Builds the _turboquant extension with the project's CMake build (python/CMakeLists.txt) for
`pip install ./python --no-build-isolation`.

Where ./scripts/build made the checkout's build/ tree, the extension is built there as it is configured
(its own target only: what is already built is not built again), provided it is for this interpreter's
Python version (the module's file name says; otherwise the install stops and says so). Otherwise a tree
of its own, python/build-pip, is configured for the interpreter running pip (kept: a second install
recompiles only what changed); CMAKE_ARGS adds options to that configure step, as llama-cpp-python's build
takes them (CMAKE_ARGS="-DTQ_CUDA=OFF" leaves out the CUDA backend where nvcc is installed)."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        if not (ROOT / "CMakeLists.txt").exists() or not (ROOT / "src").is_dir():
            raise RuntimeError(f"{ROOT} is not a turboquant.cpp checkout: the extension is built from the project's sources")
        built_name = Path(self.get_ext_filename(ext.name)).name
        build = ROOT / "build"
        if (build / "CMakeCache.txt").exists() and "TQ_PYTHON:BOOL=ON" in (build / "CMakeCache.txt").read_text():
            subprocess.run(["cmake", "--build", str(build), "--target", "_turboquant"], check=True)
            built = build / "python" / "turboquant" / built_name
            if not built.exists():
                raise RuntimeError(f"{build} builds the extension for another Python ({sorted((build / 'python' / 'turboquant').glob('_turboquant*'))}), "
                                   f"not {built_name}: run pip with that Python, or move {build} aside")
            self._install(built, ext)
            return
        build = HERE / "build-pip"
        configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                     "-DTQ_BUILD_TESTS=OFF", "-DTQ_PYTHON=ON", f"-DPython_EXECUTABLE={sys.executable}"]
        if shutil.which("ccache"):
            configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
        configure += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "_turboquant", "-j", str(os.cpu_count() or 1)], check=True)
        self._install(build / "python" / "turboquant" / built_name, ext)

    def _install(self, built, ext):
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        self.copy_file(str(built), str(target))


setup(ext_modules=[CMakeExtension("turboquant._turboquant")], cmdclass={"build_ext": CMakeBuild})

"""Builds the _turboquant extension with the project's CMake build (python/CMakeLists.txt) for
`pip install ./python --no-build-isolation`. The build tree is python/build-pip (kept, so a second install
only recompiles what changed); the interpreter is the one running pip. CMAKE_ARGS adds options to the
configure step, as llama-cpp-python's build takes them (CMAKE_ARGS="-DTQ_CUDA=OFF" skips the CUDA backend
where nvcc is installed)."""

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
        build = HERE / "build-pip"
        configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                     "-DTQ_BUILD_TESTS=OFF", "-DTQ_PYTHON=ON", f"-DPython_EXECUTABLE={sys.executable}"]
        if shutil.which("ccache"):
            configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
        configure += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "_turboquant", "-j", str(os.cpu_count() or 1)], check=True)
        built = build / "python" / "turboquant" / Path(self.get_ext_filename(ext.name)).name
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        self.copy_file(str(built), str(target))


setup(ext_modules=[CMakeExtension("turboquant._turboquant")], cmdclass={"build_ext": CMakeBuild})

"""Builds attnrnn with CMake (Ninja) into the Python package.

`pip install .` or, for development, `pip install --no-build-isolation -e .`. CMake installs the
libraries, headers, CMake package and the `_C` module into the package directory, so the package is
also a CMake prefix (`attnrnn.cmake_prefix_path`). Environment knobs:
  ATTNRNN_CUDA=AUTO|ON|OFF          build the CUDA kernels (AUTO: when nvcc is found)
  ATTNRNN_CUDA_ARCHITECTURES=       the CUDA targets: empty = the GPUs present (without one: sm_90a
                                    and compute_80 PTX), "all" = a fat build (sm_80, 86, 89, 90a,
                                    100), or a CMAKE_CUDA_ARCHITECTURES list such as "80;90a"
  ATTNRNN_CPU_ARCH=native           -march of the CPU kernels ("" for the compiler default)
  ATTNRNN_BUILD_JOBS=N              parallel build jobs
  ATTNRNN_CMAKE_ARGS="..."          extra CMake arguments
"""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def run(self):
        # setuptools clears `inplace` while building and copies the module afterwards.
        self._in_source = bool(self.inplace) or getattr(self, "editable_mode", False)
        super().run()

    def build_extension(self, ext):
        import torch  # the build needs the torch it will run with

        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        # An editable install keeps the libraries, headers and CMake package in the source package
        # (setuptools copies back only the module itself).
        package_dir = ROOT / "python" / "attnrnn" if self._in_source else ext_path.parent
        # A fixed build tree keeps rebuilds incremental across (editable) installs.
        build_dir = ROOT / "build" / f"cmake-py{sys.version_info.major}{sys.version_info.minor}"
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('ATTNRNN_BUILD_TYPE', 'Release')}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DATTNRNN_PYTHON_PACKAGE_DIR={package_dir}",
            f"-DATTNRNN_CUDA={os.environ.get('ATTNRNN_CUDA', 'AUTO')}",
            f"-DATTNRNN_CPU_ARCH={os.environ.get('ATTNRNN_CPU_ARCH', 'native')}",
        ]
        # Chosen anew by every build (cmake/CudaArchitectures.cmake): an architecture list cached by
        # an earlier configure of this build tree does not stick (ATTNRNN_CMAKE_ARGS may set one).
        args += [
            f"-DATTNRNN_CUDA_ARCHITECTURES={os.environ.get('ATTNRNN_CUDA_ARCHITECTURES', '')}",
            "-UCMAKE_CUDA_ARCHITECTURES",
        ]
        args += shlex.split(os.environ.get("ATTNRNN_CMAKE_ARGS", ""))
        # The cmake and ninja installed beside this Python (pip's packages) come first, then PATH.
        tools = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        cmake = shutil.which("cmake", path=tools) or "cmake"
        ninja = shutil.which("ninja", path=tools)
        if ninja:
            args.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
        jobs = os.environ.get("ATTNRNN_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.run([cmake, "-S", str(ROOT), "-B", str(build_dir), *args], check=True)
        subprocess.run([cmake, "--build", str(build_dir), "--parallel", jobs], check=True)
        subprocess.run([cmake, "--install", str(build_dir)], check=True)
        installed = package_dir / ext_path.name
        if installed != ext_path:
            ext_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(installed, ext_path)


setup(
    ext_modules=[CMakeExtension("attnrnn._C")],
    cmdclass={"build_ext": CMakeBuild},
)

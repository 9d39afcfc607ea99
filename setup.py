"""Build step: the CUDA sources in the top-level ``kernels/`` go into the wheel as
``sglang_flatcake/kernels/*.cu`` (where ``device.kernel_path`` looks in an install).
Everything else is configured in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

KERNELS = Path(__file__).resolve().parent / "kernels"


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        dest = Path(self.build_lib) / "sglang_flatcake" / "kernels"
        dest.mkdir(parents=True, exist_ok=True)
        sources = sorted(KERNELS.glob("*.cu"))
        if not sources:
            raise RuntimeError(f"no CUDA sources in {KERNELS}: the wheel would ship no kernels")
        for cu in sources:
            shutil.copy2(cu, dest / cu.name)


setup(cmdclass={"build_py": BuildPyWithKernels})

"""Build sglang_storage's C extensions in place, for a source tree used without installing.

``pip install`` (``make setup``) builds them from pyproject.toml's ``ext-modules``; this
script builds the same modules next to their sources where the package is used from the
tree through ``PYTHONPATH`` (``ci/gpu_check.sh`` on a machine without network). It needs
only setuptools, a C compiler, OpenSSL's headers and xxhash.h, and builds each module on
its own: one that fails is reported and skipped, and the package then runs its Python
paths.

Run: ``python ci/build_native.py`` (exit code 0 when every module was built, 1 otherwise).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

from setuptools import Distribution, Extension
from setuptools.errors import BaseError, CCompilerError

REPO = Path(__file__).resolve().parents[1]


def _extensions() -> list[Extension]:
    with (REPO / "pyproject.toml").open("rb") as handle:
        project: dict[str, Any] = tomllib.load(handle)
    modules = project["tool"]["setuptools"]["ext-modules"]
    return [
        Extension(
            module["name"],
            sources=[str(REPO / source) for source in module["sources"]],
            libraries=list(module.get("libraries", [])),
        )
        for module in modules
    ]


def main() -> int:
    """Build every extension in place; report each one."""
    failed = 0
    for extension in _extensions():
        distribution = Distribution({"name": "sglang-storage", "ext_modules": [extension]})
        command = distribution.get_command_obj("build_ext")
        command.inplace = True
        command.build_temp = str(REPO / "build" / "native")
        try:
            command.ensure_finalized()
            command.run()
        except (BaseError, CCompilerError, OSError) as error:  # no compiler, or headers
            failed += 1
            print(f"build_native: {extension.name} not built: {error}", file=sys.stderr)  # noqa: T201
            continue
        print(f"build_native: built {extension.name}")  # noqa: T201
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The one thing setup.cfg cannot declare: the C extensions (shmcache/node/native.c, the node
layer's hot transactions; shmcache/kernel/mapping.c, copy-on-write views, and
shmcache/format/arrays.c, the arrays of a value, both built against numpy's C API;
shmcache/keys/native.c, key construction).

Metadata, dependencies and entry points live in setup.cfg; tool settings in pyproject.toml.
There is no pure-Python fallback: without a C compiler (and zlib's header) the install fails here,
saying what is missing.
"""

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildNative(build_ext):
    """build_ext that turns a missing compiler or header into one clear message."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            raise SystemExit(
                "shmcache: building its C extensions failed: "
                f"{exc}\nshmcache needs a C compiler and zlib's header: on Debian/Ubuntu "
                "`apt-get install gcc zlib1g-dev` (the README's test command installs them)."
            ) from exc


_FLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

setup(
    ext_modules=[
        Extension(
            "shmcache.node._native", ["shmcache/node/native.c"], libraries=["z"], extra_compile_args=_FLAGS
        ),
        Extension(
            "shmcache.kernel._mapping",
            ["shmcache/kernel/mapping.c"],
            include_dirs=[numpy.get_include()],
            extra_compile_args=_FLAGS,
        ),
        Extension(
            "shmcache.format._arrays",
            ["shmcache/format/arrays.c"],
            include_dirs=[numpy.get_include()],
            extra_compile_args=_FLAGS,
        ),
        Extension("shmcache.keys._native", ["shmcache/keys/native.c"], extra_compile_args=_FLAGS),
    ],
    cmdclass={"build_ext": BuildNative},
)

"""Package discovery (the rest of the build is in pyproject.toml).

setuptools' `find` does not apply `package-dir`, and kernels/ and quant/ install under other names
(hetero.kernels, hetero.quant: `kernels` and `quant` are taken on PyPI), so their subpackages are
found in their own folders and renamed here. Nothing is listed by hand: a new subpackage ships.
"""

from setuptools import find_packages, setup

PACKAGES = find_packages(include=["hetero", "hetero.*"])
for top in ("kernels", "quant"):
    PACKAGES += [f"hetero.{p}" for p in find_packages(include=[top, f"{top}.*"])]

setup(packages=PACKAGES)

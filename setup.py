"""Maps the top-level folders onto one import package, `tessera`.

operator/ -> tessera.operator, runtime/ -> tessera.runtime, kernels/ -> tessera.kernels.
(A top-level `operator` package would shadow Python's standard library.)
"""

from setuptools import find_packages, setup

ROOTS = {
    "tessera": "tessera",
    "tessera.operator": "operator",
    "tessera.runtime": "runtime",
    "tessera.kernels": "kernels",
}

packages: list[str] = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=ROOTS)

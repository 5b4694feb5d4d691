"""The folders services/ and shared/ install as one namespace: pagedserve.services, pagedserve.shared."""

from setuptools import find_packages, setup

TOP_LEVEL = ("services", "shared")

setup(
    packages=[f"pagedserve.{name}" for name in find_packages(include=[f"{top}*" for top in TOP_LEVEL])],
    package_dir={f"pagedserve.{top}": top for top in TOP_LEVEL},
)

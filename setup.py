"""jaxpipe: pipeline-parallel training in JAX.  The package metadata lives in pyproject.toml; this file
stays for tools that call setup.py directly."""

from setuptools import setup

setup()

"""jaxpipe: pipeline-parallel training in JAX (GPipe, 1F1B, ... as shard_map programs)."""
from setuptools import find_packages, setup

# Pinned to the versions this project is tested with (see BUILD_NOTES.md): JAX moves fast.
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "chex==0.1.92",
    "orbax-checkpoint==0.12.8",
    "absl-py==2.5.1",
    "numpy==2.4.6",
    "matplotlib==3.11.2",
    "scikit-learn==1.9.1",
    "tqdm==4.70.1",
    "pytest==9.2.0",
    "pytest-xdist==3.8.0",
]

setup(
    name="jaxpipe",
    version="0.1.0",
    description="Pipeline-parallel training in JAX: GPipe, 1F1B and more, each one shard_map program",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["jaxpipe", "jaxpipe.*", "experiments", "experiments.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
)

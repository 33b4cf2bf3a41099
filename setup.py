"""Install hylo: distributed second-order training with a hybrid low-rank natural gradient."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="hylo",
    version="0.1.0",
    description="HyLo: a hybrid low-rank natural-gradient preconditioner for PyTorch (K-FAC, SNGD, KID, KIS)",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hylo", "hylo.*"]),
    package_data={"hylo": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.1", "scipy", "pandas", "matplotlib", "torchinfo"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "mlxtend", "ruff", "mypy"],
        "scripts": ["mlxtend", "pillow"],
    },
)

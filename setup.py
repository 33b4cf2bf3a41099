"""Thin shim for tools that still call setup.py: the package metadata lives in pyproject.toml."""

from setuptools import setup

setup()

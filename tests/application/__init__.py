"""The application: the training scripts, benchmarks, launchers and figures built on hylo (docs/contributing.md, "Tests")."""

"""The repository: its structure, documentation, packaging and test kit (docs/contributing.md, "Tests")."""

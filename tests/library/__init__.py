"""The library's specification: what ``hylo`` does, against independent references (docs/contributing.md, "Tests")."""

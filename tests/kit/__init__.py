"""Shared test kit: the forked-gloo harness, small models, dense references and tolerances."""

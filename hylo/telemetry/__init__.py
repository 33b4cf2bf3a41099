"""Telemetry: where a step's time goes, what is written to ``profile_dir``, and the paper's studies.

- :mod:`~hylo.telemetry.profiling`: the :class:`~hylo.telemetry.profiling.Stopwatch` that charges a
  step's time to layers and phases;
- :mod:`~hylo.telemetry.recording`: append-only CSV files and ``run.json``;
  :mod:`~hylo.telemetry.recorder`: one method per file;
- :mod:`~hylo.telemetry.studies`: the rank and gradient-error studies;
- :mod:`~hylo.telemetry.monitor`: :class:`~hylo.telemetry.monitor.Telemetry`, all of it for one
  preconditioner.
"""

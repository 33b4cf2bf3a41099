"""The step pipeline: how a step is executed, apart from the per-layer math (docs/design.md, "Data path of one
step"). :mod:`hylo.pipeline.apply` runs the step between updates per group of equal layers."""

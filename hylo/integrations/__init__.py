"""hylo in training stacks: callbacks for Hugging Face's ``Trainer`` and for Lightning (docs/training-stacks.md).

:mod:`hylo.integrations.transformers` and :mod:`hylo.integrations.lightning` each import their stack when imported
themselves; this package imports nothing, and ``import hylo`` never imports it. Accelerate needs no module: its
recipes use :class:`hylo.HyLoOptimizer` or :class:`hylo.HyLoPreconditioner` directly (docs/training-stacks.md,
"Accelerate").
"""

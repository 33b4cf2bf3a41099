"""The scripts' models: :mod:`~hylo_scripts.models.registry` (the models a run names, with their tasks' inputs),
:mod:`~hylo_scripts.models.moe` (small mixture-of-experts models and their ``nn.Linear`` twins) and the tiny models
of the model families hylo is run on (:mod:`~hylo_scripts.models.model_families`,
:mod:`~hylo_scripts.models.vision_families`). It imports nothing else of the scripts."""

"""The scripts' datasets: :mod:`~hylo_scripts.data.registry` names them (a name and ``DataOptions`` give the train
and test splits), :mod:`~hylo_scripts.data.datasets` knows their on-disk formats, transforms and layout errors, and
:mod:`~hylo_scripts.data.text` the byte corpora of the language model. It imports nothing else of the scripts."""

"""Models written as a user would write them in a file, for ``autofit bench``.

Each module has a ``workload()`` function: load one with ``--model path/to/vit.py:workload``
(as a user would) or ``--model autofit.bench.user_models.vit:workload``. They are not
built-ins: the estimator was not built around their structure or optimizer.
"""

"""Hugging Face ``transformers`` models as workloads (the ``hf`` extra: transformers, peft).

``--model hf:SPEC`` and :func:`hf_workload`; see :mod:`autofit.hf.spec` for SPEC and
:mod:`autofit.hf.workload` for tasks, batches and LoRA.
"""

from autofit.hf.spec import PREFIX
from autofit.hf.workload import hf_workload, load_hf_source

__all__ = ["PREFIX", "hf_workload", "load_hf_source"]

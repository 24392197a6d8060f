"""Hugging Face ``transformers`` models as workloads (the ``hf`` extra: transformers, peft).

``--model hf:SPEC`` and :func:`hf_workload`; see :mod:`autofit.workloads.hf.spec` for SPEC and
:mod:`autofit.workloads.hf.workload` for tasks, batches and LoRA.
"""

from autofit.workloads.hf.spec import PREFIX
from autofit.workloads.hf.workload import hf_workload, load_hf_source

__all__ = ["PREFIX", "hf_workload", "load_hf_source"]

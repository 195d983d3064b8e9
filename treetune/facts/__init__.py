"""Facts read from what is on disk and on the node, before anything is measured: a model's
size and KV cache from its Hugging Face config.json, the GPU from nvidia-smi (amd-smi,
rocm-smi) and a shipped table of datasheet values, and the auto prior built from them."""

from treetune.facts.gpus import (
    GpuFacts,
    SeenGpu,
    detect_gpu,
    gpu_facts,
    gpu_table,
    query_gpus,
    seen_model,
)
from treetune.facts.models import (
    ModelFacts,
    MoEFacts,
    facts_from_config,
    find_config,
    hub_cache,
    model_facts,
)
from treetune.facts.prior import auto_prior, build_prior

__all__ = ["GpuFacts", "MoEFacts", "ModelFacts", "SeenGpu", "auto_prior", "build_prior",
           "detect_gpu", "facts_from_config", "find_config", "gpu_facts", "gpu_table",
           "hub_cache", "model_facts", "query_gpus", "seen_model"]

"""Virtual-time planning of a deployment: hardware and model presets and the stage cost models
that controller/executor/simulated.py runs the real scheduler against."""

from controller.simulator.cost_model import AnalyticCostModel, Deployment, Efficiency, StageCost
from controller.simulator.hardware import GPUS, LINKS, GpuSpec, LinkSpec, get_gpu, get_link
from controller.simulator.models import MODELS, ModelSpec, get_model, model_from_hf_config
from controller.simulator.profile import MeasuredProfile

__all__ = [
    "GPUS",
    "LINKS",
    "MODELS",
    "AnalyticCostModel",
    "Deployment",
    "Efficiency",
    "GpuSpec",
    "LinkSpec",
    "MeasuredProfile",
    "ModelSpec",
    "StageCost",
    "get_gpu",
    "get_link",
    "get_model",
    "model_from_hf_config",
]

"""Profile a model, partition it into balanced stages, and plan its PTD-P layout.

    from torchpp import plan
    prof = plan.profile(blocks, sample)                       # per-block F, I, W times and bytes
    split = plan.partition(prof, num_workers=4)                # PipeDream's DP, exact
    best = plan.plan(plan.PRESETS["gpt3-175b"], plan.Cluster(96, 80e9), plan.Training(1536, 2048)).best

``python -m torchpp.plan --help`` runs the planner from the command line.
"""
from torchpp.plan.memory import layer_activation_bytes, model_state_bytes, rank_activation_bytes, zero_traffic_bytes
from torchpp.plan.model_config import PRESETS, ModelConfig, load_model_config
from torchpp.plan.partition import Partition, partition
from torchpp.plan.planner import Candidate, Cluster, Layout, Plan, PlanError, Training, evaluate, plan
from torchpp.plan.profiler import LayerProfile, Profile, profile
from torchpp.plan.saved_activations import SavedActivationMeter
from torchpp.plan.schedule_sim import peak_inflight, simulate_schedule

__all__ = [
    "Candidate", "Cluster", "LayerProfile", "Layout", "ModelConfig", "PRESETS", "Partition", "Plan", "PlanError",
    "Profile", "SavedActivationMeter", "Training", "evaluate", "layer_activation_bytes", "load_model_config",
    "model_state_bytes", "partition", "peak_inflight", "plan", "profile", "rank_activation_bytes",
    "simulate_schedule", "zero_traffic_bytes",
]
